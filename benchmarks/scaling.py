"""Scaling experiments for docs/experiments: compile time against depth and width, and step
time / memory against model size with and without remat.

    python benchmarks/scaling.py compile [--depths 2 4 8 16 32] [--widths 128 256 512]
    python benchmarks/scaling.py step [--variants ...] [--batch 4 --seq 256 --steps 3]

`compile` times tracing + XLA compilation of the full eqllm training step (forward, backward,
AdamW update, metrics: `TrainStep.lower(...).compile()`) for llama-nano-shaped models, layers
scanned (eqllm's default) and unrolled (a Python loop, for comparison). `step` runs
`eqllm.bench.run_bench` over the research-scale variants with remat "none" and "full".
Each writes a markdown page and a PNG into --out (default docs/experiments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

import eqllm
from eqllm import zoo
from eqllm.bench import machine_info, markdown_table, run_bench
from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens


def compile_seconds(cfg, batch: int, seq: int) -> tuple[float, float]:
    """(trace + lower, XLA compile) seconds of the training step for `cfg`."""
    jax.clear_caches()
    b = JaxBench(cfg, random_tokens(cfg.vocab_size, batch, seq))
    b.compile()
    return b.lower_s, b.compile_s


def compile_study(args) -> dict:
    base = zoo.config(args.variant)
    # One throwaway compile first: the first compile in a process pays one-off set-up costs
    # that would otherwise inflate the smallest model's figure.
    compile_seconds(bench_config(base.replace(n_layers=1), args.seq), args.batch, args.seq)
    rows = []
    for scan in (True, False):
        for depth in args.depths:
            if not scan and depth > args.max_unrolled:
                continue
            cfg = bench_config(base.replace(n_layers=depth), args.seq).replace(scan_layers=scan)
            lower, comp = compile_seconds(cfg, args.batch, args.seq)
            rows.append(
                {
                    "axis": "depth",
                    "scan": scan,
                    "n_layers": depth,
                    "d_model": cfg.d_model,
                    "lower_s": lower,
                    "compile_s": comp,
                }
            )
            print(rows[-1], file=sys.stderr)
    for width in args.widths:
        heads = max(width // 64, 1)
        cfg = base.replace(
            d_model=width,
            attention={"n_heads": heads, "n_kv_heads": heads},
            mlp={"d_ff": 4 * width},
        )
        cfg = bench_config(cfg, args.seq).replace(scan_layers=True)
        lower, comp = compile_seconds(cfg, args.batch, args.seq)
        rows.append(
            {
                "axis": "width",
                "scan": True,
                "n_layers": cfg.n_layers,
                "d_model": width,
                "lower_s": lower,
                "compile_s": comp,
            }
        )
        print(rows[-1], file=sys.stderr)
    return {"rows": rows}


def write_compile_page(result: dict, out: Path, command: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for scan, style in ((True, "o-"), (False, "s--")):
        pts = [r for r in rows if r["axis"] == "depth" and r["scan"] == scan]
        axes[0].plot(
            [r["n_layers"] for r in pts],
            [r["lower_s"] + r["compile_s"] for r in pts],
            style,
            label="lax.scan" if scan else "unrolled",
        )
    axes[0].set(xlabel="layers", ylabel="trace + compile, s", title="compile time vs depth")
    axes[0].set_xscale("log", base=2)
    axes[0].legend()
    pts = [r for r in rows if r["axis"] == "width"]
    axes[1].plot([r["d_model"] for r in pts], [r["lower_s"] + r["compile_s"] for r in pts], "o-")
    axes[1].set(xlabel="d_model", ylabel="trace + compile, s", title="compile time vs width")
    axes[1].set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(out / "compile_time.png", dpi=110)
    plt.close(fig)

    depth = {
        (r["scan"], r["n_layers"]): r["lower_s"] + r["compile_s"]
        for r in rows
        if r["axis"] == "depth"
    }
    scan_depths = sorted(d for s, d in depth if s)
    lines = [
        "# Compile time against depth and width",
        "",
        f"Regenerate: `{command}`",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "",
        "Seconds to trace, lower and compile the whole training step (forward, backward, AdamW "
        "update and metrics, `TrainStep.lower(...).compile()`), llama-nano-shaped models; "
        "nothing cached (`jax.clear_caches()` before each).",
        "",
        "| axis | layers | d_model | layers run by | trace+lower s | XLA compile s | total s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['axis']} | {r['n_layers']} | {r['d_model']} | "
            f"{'lax.scan' if r['scan'] else 'unrolled loop'} | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} | {r['lower_s'] + r['compile_s']:.2f} |"
        )
    if len(scan_depths) >= 2:
        lo, hi = scan_depths[0], scan_depths[-1]
        lines += [
            "",
            f"Scanned: {hi} layers compile in {depth[(True, hi)] / depth[(True, lo)]:.2f}x "
            f"the time of {lo} layers.",
        ]
    lines += ["", "![compile time](compile_time.png)", ""]
    (out / "compile_time.md").write_text("\n".join(lines))


def step_study(args) -> list:
    results = []
    for remat in ("none", "full"):
        results += run_bench(
            args.variants,
            batch=args.batch,
            seq=args.seq,
            steps=args.steps,
            warmup=1,
            remat=remat,
            log=lambda s: print(s, file=sys.stderr),
        )
    return results


def write_step_page(results, out: Path, command: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for remat, style in (("none", "o-"), ("full", "s--")):
        rs = sorted((r for r in results if r.remat == remat), key=lambda r: r.params)
        for fam in ("gpt2", "llama"):
            pts = [r for r in rs if r.variant.startswith(fam)]
            axes[0].plot(
                [r.params / 1e6 for r in pts],
                [1e3 * r.step_median for r in pts],
                style,
                label=f"{fam}, remat={remat}",
            )
            axes[1].plot(
                [r.params / 1e6 for r in pts],
                [(r.memory_bytes or 0) / 2**20 for r in pts],
                style,
                label=f"{fam}, remat={remat}",
            )
    axes[0].set(xlabel="parameters, M", ylabel="step ms (median)", title="step time vs size")
    axes[1].set(xlabel="parameters, M", ylabel="MiB (XLA buffers)", title="step memory vs size")
    for ax in axes:
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_scaling.png", dpi=110)
    plt.close(fig)
    r0 = results[0]
    lines = [
        "# Step time and memory against model size, with and without remat",
        "",
        f"Regenerate: `{command}`",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- batch x seq: {r0.batch} x {r0.seq}, fp32",
        "",
        markdown_table(results),
        "",
        "Memory: XLA's buffer assignment for the compiled step (arguments + outputs + "
        "temporaries). remat=full recomputes each block in the backward pass "
        "(`jax.checkpoint`, nothing saveable): less memory, about one extra forward.",
        "",
        "![step time and memory](step_scaling.png)",
        "",
    ]
    (out / "step_scaling.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="study", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--variant", default="llama-nano")
    c.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    c.add_argument("--max-unrolled", type=int, default=16)
    c.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 1024])
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq", type=int, default=128)
    s = sub.add_parser("step")
    s.add_argument(
        "--variants",
        nargs="+",
        default=["gpt2-nano", "gpt2-micro", "gpt2-mini", "llama-nano", "llama-micro", "llama-mini"],
    )
    s.add_argument("--batch", type=int, default=4)
    s.add_argument("--seq", type=int, default=256)
    s.add_argument("--steps", type=int, default=3)
    for p in (c, s):
        p.add_argument("--out", default="docs/experiments")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.perf_counter()
    info = machine_info()  # before this run writes its own outputs into the checkout
    if args.study == "compile":
        result = compile_study(args)
        (out / "compile_time.json").write_text(json.dumps(result, indent=2) + "\n")
        write_compile_page(result, out, command, info)
    else:
        results = step_study(args)
        (out / "step_scaling.json").write_text(
            json.dumps([r.to_dict() for r in results], indent=2) + "\n"
        )
        write_step_page(results, out, command, info)
    print(f"done in {time.perf_counter() - t0:.0f}s; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
