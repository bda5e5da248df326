"""A sweep's results: results.jsonl (one line per finished point), results.md and two plots.

lr_transfer.png is loss against log2 of the learning rate, one curve per width (the
muTransfer figure: under muP the curves' minima line up); loss_vs_compute.png is loss against
training FLOPs, coloured by parameters (the raw material of `eqllm fit`).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

from eqllm.sweep.point import read_json
from eqllm.sweep.spec import Sweep


def collect(sweep: Sweep, out: Path) -> list[dict]:
    """The result rows of every finished point in `out`, in point order (any shard's)."""
    rows = [read_json(out / p.name / "result.json") for p in sweep.points]
    return [r for r in rows if r is not None]


def write_results(sweep: Sweep, out: Path, *, echo=print) -> list[Path]:
    """results.jsonl, results.md, lr_transfer.png and loss_vs_compute.png in `out`."""
    rows = collect(sweep, out)
    tmp = out / f"results.jsonl.{os.getpid()}.tmp"  # shards may write at the same time
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out / "results.jsonl")
    tmp = out / f"results.md.{os.getpid()}.tmp"
    tmp.write_text(results_markdown(sweep, rows))
    os.replace(tmp, out / "results.md")
    written = [out / "results.jsonl", out / "results.md"]
    if rows:
        written += plot_results(rows, out)
    missing = len(sweep.points) - len(rows)
    echo(
        f"results: {len(rows)} of {len(sweep.points)} points"
        + (f" ({missing} not finished yet)" if missing else "")
        + f"; wrote {', '.join(p.name for p in written)} in {out}"
    )
    return written


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def results_markdown(sweep: Sweep, rows: list[dict]) -> str:
    """A table of the points, best loss first marked, diverged ones said so."""
    keys = list(dict.fromkeys(k for r in rows for k in r["settings"]))
    finite = [r for r in rows if r["loss"] is not None]
    best = min(finite, key=lambda r: r["loss"])["point"] if finite else None
    lines = [
        f"# Sweep {sweep.name}",
        "",
        f"Base recipe `{sweep.recipe}`, fixed settings {sweep.fixed or 'none'}; "
        f"{len(rows)} of {len(sweep.points)} points finished. Regenerate with "
        f"`eqllm sweep {sweep.path}`.",
        "",
        "| point | " + " | ".join(keys) + " | params | non-emb. params | tokens | FLOPs | loss "
        "| best loss | diverged | seconds |",
        "|" + "---|" * (len(keys) + 9),
    ]
    for r in rows:
        settings = " | ".join(str(r["settings"].get(k, "")) for k in keys)
        mark = " **(best)**" if r["point"] == best else ""
        lines.append(
            f"| {r['point']}{mark} | {settings} | {r['params']:,} | {r['non_embedding_params']:,} "
            f"| {r['tokens']:,} | {r['flops']:.3g} | {_fmt(r['loss'], '.4f')} "
            f"| {_fmt(r['best_loss'], '.4f')} | {'yes' if r['diverged'] else ''} "
            f"| {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_results(rows: list[dict], out: Path) -> list[Path]:
    """lr_transfer.png and loss_vs_compute.png (diverged points drawn as crosses at the top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rows if r["loss"] is not None]
    top = max((r["loss"] for r in finite), default=1.0)
    kinds = sorted({r.get("parametrization", "sp") for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for kind, ax in zip(kinds, axes[0], strict=True):
        by_width = defaultdict(list)
        for r in rows:
            if r.get("parametrization", "sp") == kind:
                by_width[r["d_model"]].append(r)
        colors = plt.cm.viridis([i / max(1, len(by_width) - 1) * 0.9 for i in range(len(by_width))])
        for color, (width, group) in zip(colors, sorted(by_width.items()), strict=True):
            ok = sorted((r for r in group if r["loss"] is not None), key=lambda r: r["lr"])
            x = [math.log2(r["lr"]) for r in ok]
            ax.plot(x, [r["loss"] for r in ok], "o-", color=color, label=f"d_model {width}")
            bad = [math.log2(r["lr"]) for r in group if r["loss"] is None]
            ax.scatter(bad, [top] * len(bad), marker="x", color=color)
        ax.set(
            xlabel="log2 learning rate",
            ylabel="final validation loss",
            title=f"{kind}: loss against learning rate per width (x: diverged)",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    lr_path = out / "lr_transfer.png"
    fig.savefig(lr_path, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    if finite:
        points = ax.scatter(
            [r["flops"] for r in finite],
            [r["loss"] for r in finite],
            c=[math.log10(r["params"]) for r in finite],
            cmap="viridis",
        )
        fig.colorbar(points, label="log10 parameters")
    ax.set(
        xscale="log",
        xlabel="training FLOPs",
        ylabel="final validation loss",
        title="loss against compute",
    )
    fig.tight_layout()
    compute_path = out / "loss_vs_compute.png"
    fig.savefig(compute_path, dpi=110)
    plt.close(fig)
    return [lr_path, compute_path]
