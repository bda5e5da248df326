"""One benchmark row (`BenchResult`) and the report: a printed table, markdown, JSON and plots."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from eqllm.train.mfu import mfu

FLOPS_CONVENTION = (
    "FLOPs/token = 6 N + 12 L H Q T (N: matmul parameters, embeddings excluded unless tied; "
    "attention per PaLM appendix B, not halved for the causal mask; recomputation not counted)"
)


@dataclasses.dataclass
class BenchResult:
    """The measurements of one (variant, framework) pair.

    `compile_s`: tracing + compilation of the whole training step (forward, backward, update);
    for torch.compile the extra time of the first compiled step over a steady step.
    `step_s`: wall time of every timed step (after warm-up), in seconds.
    `memory_bytes`: peak memory of the step, measured as `memory_source` says.
    """

    variant: str
    framework: str
    dtype: str
    batch: int
    seq: int
    params: int
    flops_per_token: float
    compile_s: float | None
    step_s: list[float]
    peak_flops: float | None
    peak_source: str
    memory_bytes: int | None
    memory_source: str
    remat: str = "none"
    xla_flops_per_token: float | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def step_median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_median

    @property
    def mfu(self) -> float | None:
        return mfu(self.tokens_per_s, self.flops_per_token, self.peak_flops)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            step_median_s=self.step_median,
            step_min_s=min(self.step_s),
            step_max_s=max(self.step_s),
            tokens_per_s=self.tokens_per_s,
            mfu=self.mfu,
        )
        return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def table_rows(results: list[BenchResult]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells; `vs eqllm` is tokens/s relative to eqllm on the same variant."""
    header = [
        "variant",
        "framework",
        "dtype",
        "remat",
        "params",
        "compile s",
        "step ms (min-max)",
        "tokens/s",
        "vs eqllm",
        "MFLOP/token",
        "MFU",
        "memory MiB",
    ]
    base = {
        (r.variant, r.remat): r.tokens_per_s for r in results if r.framework.startswith("eqllm")
    }
    rows = []
    for r in results:
        ref = base.get((r.variant, r.remat))
        rows.append(
            [
                r.variant,
                r.framework,
                r.dtype,
                r.remat,
                f"{r.params / 1e6:.2f}M",
                "-" if r.compile_s is None else f"{r.compile_s:.1f}",
                f"{1e3 * r.step_median:.0f} ({1e3 * min(r.step_s):.0f}-{1e3 * max(r.step_s):.0f})",
                f"{r.tokens_per_s:,.0f}",
                "-" if ref is None else f"{r.tokens_per_s / ref:.2f}x",
                f"{r.flops_per_token / 1e6:.1f}",
                "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                _mib(r.memory_bytes),
            ]
        )
    return header, rows


def format_table(results: list[BenchResult]) -> str:
    """A fixed-width text table for the terminal."""
    header, rows = table_rows(results)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    head = "  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))
    return "\n".join([head, "-" * len(head), *lines])


def markdown_table(results: list[BenchResult]) -> str:
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(
    results: list[BenchResult], out: str | Path, meta: dict[str, Any], plots: bool = True
) -> dict[str, Path]:
    """Write `bench.md`, `bench.json` and (with `plots`) `bench.png` under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md"}
    paths["json"].write_text(
        json.dumps({"meta": meta, "results": [r.to_dict() for r in results]}, indent=2) + "\n"
    )
    peaks = sorted({(r.peak_source, r.peak_flops) for r in results}, key=str)
    lines = [
        "# eqllm bench",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
        *[f"- {k}: {v}" for k, v in meta.items() if k != "command"],
        "",
        markdown_table(results),
        "",
        "Step time: median over the timed steps (min-max); frameworks alternate step by step "
        "in one process.",
        f"{FLOPS_CONVENTION}.",
        "MFU peak: "
        + "; ".join(
            f"{src} = {p / 1e9:,.1f} GFLOP/s" if p else f"{src} (no MFU)" for src, p in peaks
        )
        + ".",
        "Memory: " + "; ".join(sorted({f"{r.framework}: {r.memory_source}" for r in results})),
        "",
    ]
    if plots:
        paths["png"] = out / "bench.png"
        plot_results(results, paths["png"])
        lines += ["![tokens/s and compile time](bench.png)", ""]
    paths["md"].write_text("\n".join(lines))
    return paths


def plot_results(results: list[BenchResult], path: str | Path) -> None:
    """Bar charts of tokens/s and compile time per variant, one bar per framework."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(f"{r.variant}\n{r.remat}" for r in results))
    frameworks = list(dict.fromkeys(r.framework for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(frameworks)
    for j, fw in enumerate(frameworks):
        by = {f"{r.variant}\n{r.remat}": r for r in results if r.framework == fw}
        xs = [i + j * width for i in range(len(variants))]
        axes[0].bar(xs, [by[v].tokens_per_s if v in by else 0 for v in variants], width, label=fw)
        axes[1].bar(xs, [(by[v].compile_s or 0) if v in by else 0 for v in variants], width)
    for ax, title in zip(axes, ["tokens/s (higher is better)", "compile time, s"], strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(variants))], variants)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
