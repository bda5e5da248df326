"""The human-readable part of a run folder: loss.png and report.md."""

from __future__ import annotations

import json
from pathlib import Path

from eqllm.recipe import Recipe


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_loss_plot(out_dir: Path) -> Path | None:
    """loss.png: training and validation loss (nats/token) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out_dir)
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r and "tokens" in r]
    val = [(r["tokens"], r["val/loss"]) for r in rows if "val/loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(*zip(*train, strict=True), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", ms=4)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(out_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out_dir) / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def write_report(out_dir: Path, recipe: Recipe, s: dict) -> Path:
    """report.md: what was trained, on what, how well and how fast, with samples."""
    val, uni = s.get("val", {}), s.get("unigram", {})
    mem = s["peak_memory_bytes"] / 2**20
    lines = [
        f"# Run report: {recipe.name or Path(out_dir).name}",
        "",
        recipe.description,
        "",
        "| | |",
        "|---|---|",
        f"| variant | {s['variant']} |",
        f"| parameters | {s['params']:,} |",
        f"| steps | {s['steps']:,} |",
        f"| tokens seen | {s['tokens']:,} |",
        f"| final train loss | {_fmt(s.get('final_train_loss'))} |",
        f"| validation loss | {_fmt(val.get('loss'))} |",
        f"| validation perplexity | {_fmt(val.get('perplexity'), '.2f')} |",
        f"| validation bits/byte | {_fmt(val.get('bpb'))} |",
        f"| unigram baseline bits/byte | {_fmt(uni.get('bpb'))} |",
        f"| train step throughput | {s['step_tokens_per_s']:,.0f} tokens/s |",
        f"| loader throughput | {s['loader_tokens_per_s']:,.0f} tokens/s |",
        f"| MFU | {_fmt(s.get('mfu'), '.2%')} (peak {_fmt(s.get('peak_flops'), '.3g')} FLOP/s: "
        f"{s['peak_flops_source']}; {s['flops_per_token']:.3g} FLOPs/token) |",
        f"| compile time | {s['compile_s']:.2f} s (cache: {s['compile_cache']}) |",
        f"| peak memory | {mem:,.0f} MiB ({s['peak_memory_kind']}) |",
        f"| device | {s['device']} |",
        f"| wall time | {s['wall_s']:.1f} s |",
    ]
    for label, r in s.get("extra", {}).items():
        lines.append(f"| {label} bits/byte | {_fmt(r['bpb'])} |")
    lines += ["", "![loss](loss.png)", ""]
    samples = s.get("samples") or []
    if samples:
        lines += ["## Samples", ""]
        for text in samples:
            lines += ["```", text, "```", ""]
    lines += ["## Recipe", "", "```toml", recipe.to_toml().rstrip(), "```", ""]
    path = Path(out_dir) / "report.md"
    path.write_text("\n".join(lines))
    return path
