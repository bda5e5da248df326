"""Where a training step's time goes: per-op totals from a profiler trace, eqllm or PyTorch.

    python benchmarks/profile_step.py llama-mini [--batch 4 --seq 256 --steps 2 --top 25]
    python benchmarks/profile_step.py llama-mini --torch   # the transformers step, same work

Compiles the eqllm training step (`eqllm.bench.jax_bench.JaxBench`), traces `--steps` steps with
`jax.profiler.trace(create_perfetto_trace=True)`, and prints the ops (XLA fusions, thunks) with
the most time per step, each with its output shape and the source op name from the HLO metadata
(`.../eqllm.GatedMLP/...`), then totals per op kind. The optimized HLO is written next to the
trace (`--dir`, default /tmp/eqllm-profile) for reading.

With `--torch`, the step profiled is `eqllm bench`'s transformers eager step
(`eqllm.bench.torch_bench.TorchBench`) under `torch.profiler`, and the totals are ATen ops'
self time, with the share of the matrix products (`aten::mm`, `aten::addmm`, `aten::bmm`) and of
the fused attention kernel: the budget any faster implementation has to beat.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
from pathlib import Path

import jax

import eqllm
from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens

_SKIP = ("$", "Thunk", "Common", "Execute", "Slinky", "PjRt", "Pjit")


def op_times(trace_dir: Path, steps: int) -> collections.Counter:
    """Milliseconds per step of every profiled op (outer Python/runtime spans skipped)."""
    path = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(_SKIP):
            totals[e["name"]] += e["dur"] / 1e3 / steps
    return totals


def profile_torch(cfg, tokens, steps: int, top: int) -> None:
    """Print the transformers eager step's ATen self time per op, and the matmul/attention share."""
    from eqllm.bench.torch_bench import TorchBench

    bench = TorchBench(cfg, tokens)
    torch = bench.torch
    bench.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = sum(bench.step() for _ in range(steps)) / steps
    totals = collections.Counter(
        {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    )
    print(f"step {1e3 * wall:.0f} ms wall; op self time {sum(totals.values()):.0f} ms per step")
    for name, ms in totals.most_common(top):
        print(f"{ms:8.1f} ms  {name}")
    matmul = sum(totals[k] for k in ("aten::mm", "aten::addmm", "aten::bmm"))
    attention = sum(ms for k, ms in totals.items() if "scaled_dot_product" in k)
    rest = sum(totals.values()) - matmul - attention
    for what, ms in (("matrix products", matmul), ("fused attention", attention), ("rest", rest)):
        print(f"{ms:8.1f} ms  {100 * ms / sum(totals.values()):5.1f}%  {what}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dir", default="/tmp/eqllm-profile")
    parser.add_argument("--torch", action="store_true", help="profile the transformers step")
    args = parser.parse_args(argv)
    out = Path(args.dir) / args.variant
    cfg = bench_config(zoo.config(args.variant), args.seq, remat=args.remat)
    tokens = random_tokens(cfg.vocab_size, args.batch, args.seq)
    if args.torch:
        profile_torch(cfg, tokens, args.steps, args.top)
        return 0
    bench = JaxBench(cfg, tokens)
    print(f"compile {bench.compile():.1f}s")
    out.mkdir(parents=True, exist_ok=True)
    hlo = bench.compiled.compiled.as_text()
    (out / "step.hlo.txt").write_text(hlo)
    bench.step()
    with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
        wall = sum(bench.step() for _ in range(args.steps)) / args.steps
    totals = op_times(out / "trace", args.steps)
    print(f"step {1e3 * wall:.0f} ms wall; op time {sum(totals.values()):.0f} ms per step")
    for name, ms in totals.most_common(args.top):
        m = re.search(rf"%{re.escape(name)} = (\S+) .*?op_name=\"([^\"]*)\"", hlo)
        where = f"{m.group(1)}  {m.group(2)[-80:]}" if m else ""
        print(f"{ms:8.1f} ms  {name:36s} {where}")
    kinds: collections.Counter = collections.Counter()
    for name, ms in totals.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    print("by kind:")
    for kind, ms in kinds.most_common(12):
        print(f"{ms:8.1f} ms  {100 * ms / sum(kinds.values()):5.1f}%  {kind}")
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    raise SystemExit(main())
