"""Benchmarks of the training step (`eqllm bench`): compile time, step time, tokens/s, MFU and
memory per zoo variant.

With `vs_torch`, the same training step in Hugging Face transformers (eager and torch.compile)
runs in the same process, alternating step by step with the eqllm step, so the ratios survive
machine noise. `run_bench` returns one `BenchResult` per (variant, framework); `write_report`
turns them into bench.md / bench.json / bench.png.

Example:
    eqllm bench gpt2-mini llama-mini --batch 16 --seq 256 --steps 10 --vs-torch --out bench/
"""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax

from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, MatmulProbe, bench_config, random_tokens
from eqllm.bench.mesh import MESH_NOTE, MeshResult, mesh_bench, mesh_markdown
from eqllm.bench.report import (
    FLOPS_CONVENTION,
    BenchResult,
    format_table,
    markdown_table,
    write_report,
)
from eqllm.errors import EqllmError
from eqllm.recipe import OptimSpec, parse_value
from eqllm.train.mfu import device_peak_flops

__all__ = [
    "BenchResult",
    "FLOPS_CONVENTION",
    "MESH_NOTE",
    "MeshResult",
    "mesh_markdown",
    "run_mesh_bench",
    "format_table",
    "machine_info",
    "source_commit",
    "markdown_table",
    "parse_overrides",
    "run_bench",
    "write_report",
]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["d_model=32,n_layers=2", "vocab_size=97"]` -> {"d_model": 32, ...} (TOML values)."""
    out: dict[str, Any] = {}
    for item in items:
        for part in item.split(","):
            key, sep, text = part.partition("=")
            if not sep or not key.strip():
                raise EqllmError(f"--set {part!r}: expected key=value, e.g. d_model=64")
            out[key.strip()] = parse_value(text.strip())
    return out


def machine_info() -> dict[str, Any]:
    """Machine and library versions, for the report's header."""
    import equinox
    import jaxlib

    dev = jax.devices()[0]
    info = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "cpu threads": _threads(),
        "device": f"{dev.platform}: {dev.device_kind} x{jax.device_count()}",
        "python": platform.python_version(),
        "jax": f"{jax.__version__} (jaxlib {jaxlib.__version__})",
        "equinox": equinox.__version__,
        "commit": source_commit(),
    }
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if os.environ.get("XLA_FLAGS"):
        info["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    return info


def source_commit() -> str:
    """The commit of the eqllm checkout that ran, `+changes` when its tracked files outside
    docs/ differ from it: every figure on a page names the code that produced it (a benchmark
    that writes its results under docs/ as it goes does not mark its own later points)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", root, *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{commit}+changes" if changed else commit


def _threads() -> int:
    from eqllm.bench.torch_bench import cpu_threads

    return cpu_threads()


def run_bench(
    variants: Sequence[str],
    *,
    batch: int = 16,
    seq: int = 256,
    steps: int = 10,
    warmup: int = 2,
    dtype: str = "float32",
    remat: str = "none",
    vs_torch: bool = False,
    torch_compile: bool = True,
    overrides: dict[str, Any] | None = None,
    optim: OptimSpec | None = None,
    log: Callable[[str], None] = print,
    document_length: int | None = None,
) -> list[BenchResult]:
    """Benchmark each variant's training step; see the module docstring.

    Arguments:
        variants: zoo names.
        batch, seq: sequences per step and tokens per sequence.
        steps: timed steps per framework (after `warmup` untimed ones).
        dtype: compute dtype ("float32" or "bfloat16"; parameters stay fp32).
        remat: the eqllm step's remat policy.
        vs_torch: also time transformers eager (and `torch_compile`: torch.compile).
        overrides: ModelConfig fields applied to every variant (e.g. a tiny width for tests).
        document_length: eqllm's step on packed documents of this many tokens with document
            masking (segment ids); None: no masking.
    """
    if steps < 1 or warmup < 0:
        raise EqllmError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    if dtype not in ("float32", "bfloat16"):
        raise EqllmError(f"dtype={dtype!r}: use 'float32' or 'bfloat16'")
    if vs_torch:
        from eqllm.bench.torch_bench import import_torch

        import_torch()  # fail before any compiling if the extra is missing
    on_cpu = jax.devices()[0].platform == "cpu"
    probe = MatmulProbe() if on_cpu else None
    results = []
    for name in variants:
        cfg = bench_config(zoo.config(name, **(overrides or {})), seq, dtype, remat)
        tokens = random_tokens(cfg.vocab_size, batch, seq)
        flops = cfg.flops_per_token(seq)
        benches, compile_s = [], {}

        jb = JaxBench(cfg, tokens, optim=optim, document_length=document_length)
        compile_s[jb.framework] = jb.compile()
        for _ in range(warmup):
            jb.step()
        benches.append(jb)
        log(
            f"{name}: eqllm compiled in {compile_s[jb.framework]:.1f}s "
            f"(trace+lower {jb.lower_s:.1f}s, XLA {jb.compile_s:.1f}s)"
        )
        first: dict[str, float] = {}
        tb = None
        if vs_torch:
            from eqllm.bench.torch_bench import TorchBench

            for compiled in (False, True) if torch_compile else (False,):
                tb = TorchBench(cfg, tokens, optim=optim, compiled=compiled)
                first[tb.framework] = tb.step()
                for _ in range(max(warmup - 1, 0)):
                    tb.step()
                benches.append(tb)
                log(f"{name}: {tb.framework} first step {first[tb.framework]:.1f}s")

        times: dict[str, list[float]] = {b.framework: [] for b in benches}
        for i in range(steps):
            for b in benches:  # alternate frameworks step by step
                times[b.framework].append(b.step())
            if probe is not None:
                probe.measure()
            log(
                f"{name}: step {i + 1}/{steps} "
                + " ".join(f"{fw}={1e3 * ts[-1]:.0f}ms" for fw, ts in times.items())
            )

        if probe is not None:
            peak, source = probe.best, "fp32 matmul peak measured between the steps"
        else:
            peak, source = device_peak_flops()
        for b in benches:
            ts = times[b.framework]
            if b.framework in compile_s:
                comp = compile_s[b.framework]
            elif getattr(b, "compiled", False) is True:
                comp = max(first[b.framework] - sorted(ts)[len(ts) // 2], 0.0)
            else:
                comp = None
            mem = b.device_peak_memory()
            mem_source = "torch.cuda.max_memory_allocated" if mem is not None else "-"
            if isinstance(b, JaxBench):
                mem = mem if mem is not None else b.memory_bytes
                mem_source = b.memory_source
            results.append(
                BenchResult(
                    variant=name,
                    framework=b.framework,
                    dtype=dtype,
                    batch=batch,
                    seq=seq,
                    params=b.params,
                    flops_per_token=flops,
                    compile_s=comp,
                    step_s=ts,
                    peak_flops=peak,
                    peak_source=source,
                    memory_bytes=mem,
                    memory_source=mem_source,
                    remat=remat if isinstance(b, JaxBench) else "none",
                    xla_flops_per_token=(
                        b.xla_flops / (batch * seq)
                        if isinstance(b, JaxBench) and b.xla_flops
                        else None
                    ),
                )
            )
        del benches, jb, tb
        gc.collect()
    return results


def run_mesh_bench(
    variants: Sequence[str],
    meshes: Sequence[str],
    *,
    batch: int = 16,
    seq: int = 256,
    dtype: str = "float32",
    remat: str = "none",
    overrides: dict[str, Any] | None = None,
    optim: OptimSpec | None = None,
    log: Callable[[str], None] = print,
) -> list[MeshResult]:
    """Compile each variant's training step (with `optim`'s optimizer, default AdamW) on each
    mesh; memory and collectives per device (`eqllm.bench.mesh`). Nothing is run or
    allocated."""
    results = []
    for name in variants:
        cfg = bench_config(zoo.config(name, **(overrides or {})), seq, dtype, remat)
        for text in meshes:
            r = mesh_bench(name, cfg, text, batch=batch, seq=seq, optim=optim)
            log(f"{name} on {r.mesh}: compiled in {r.compile_s:.1f}s")
            results.append(r)
    return results
