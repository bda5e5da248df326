"""The page of the optimizer study, docs/experiments/optimizers.md, from study.jsonl's rows
(benchmarks/optimizer_study.py has the sweep and the arithmetic; tests/test_studies.py checks
both on a fabricated file)."""

from __future__ import annotations

from collections import defaultdict

from optimizer_study import best_row, cells_of, optimum_moves, speedup


def _lr(e: int, edge: bool = False) -> str:
    return f"2^{e}" + ("*" if edge else "")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def page(rows, widths, optimizers, *, total: int, command: str, machine: list[str]) -> str:
    """docs/experiments/optimizers.md from study.jsonl's rows (any subset of the points)."""
    cells = cells_of(rows)
    first = rows[0] if rows else {}
    lines = [
        "# Optimizers across widths under muP: "
        + ", ".join(OPTIMIZER_NAMES[o] for o in optimizers),
        "",
        f"Regenerate: `{command}` (runs or resumes `eqllm sweep` over "
        "recipes/sweeps/optimizers.toml, a learning-rate sweep per optimizer at the base width "
        "and then a few octaves around its best at the wider widths, then writes this page "
        "from study.jsonl). The setup and the rules per optimizer: "
        "[Scaling laws](../scaling-laws.md#the-studies).",
        "",
        *machine,
        f"- {len(rows)} of {total} points finished"
        + (f" ({total - len(rows)} not run yet: blank cells below)" if len(rows) < total else "")
        + f", {sum(r['diverged'] for r in rows)} diverged",
    ]
    if rows:
        lines.append(
            f"- each point: {first['steps']} steps, {first['tokens']:,} tokens, "
            f"{first['n_layers']} layers, d_ff = 4 x d_model, base width {widths[0]}; the loss "
            "is the validation loss on 5 held-out batches, logged every 10 steps"
        )
    lines += [
        "",
        "## Speedup over a tuned AdamW under muP",
        "",
        "At each width, each optimizer's best muP point against AdamW's best: the tokens it "
        "needs to reach AdamW's final loss (linear between the logged validation losses) and "
        "the speedup, AdamW's tokens to that loss over its own. One that never reaches it gets "
        "AdamW's tokens to its final loss over its tokens (below 1x).",
        "",
        "| d_model | optimizer | best lr | final loss | tokens to AdamW's loss | speedup |",
        "|---|---|---|---|---|---|",
    ]
    speedups: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for w in widths:
        baseline = best_row(cells.get(("adamw", "mup", w), {}))
        for opt in optimizers:
            best = best_row(cells.get((opt, "mup", w), {}))
            if best is None:
                continue
            reach, ratio = speedup(best, baseline) if baseline else (None, None)
            if ratio is not None and opt != "adamw":
                speedups[opt].append((w, ratio))
            lines.append(
                f"| {w} | {opt} | {_lr(best['exponent'])} | {best['loss']:.4f} | "
                f"{'-' if reach is None else f'{reach:,.0f}'} | {_x(ratio)} |"
            )
    lines.append("")
    for opt, entries in speedups.items():
        trend = ", ".join(f"{_x(r)} at {w}" for w, r in entries)
        lines.append(f"- {opt}: {trend}")
    lines += [
        "",
        "## How far each optimizer's best learning rate moves across width",
        "",
        "The best of each width's points (its final loss); * marks a best at the edge of that "
        "width's grid, where the optimum may lie further out. The base width's points serve "
        "muP and SP alike (the same model there). Moved: the widest width's best minus the "
        "base width's, in octaves (factors of 2); starred when that best is at its grid's edge "
        "(a width with only the transferred point run is all edge).",
        "",
        "| optimizer | parametrization | "
        + " | ".join(f"d_model {w}" for w in widths)
        + " | octaves moved |",
        "|---|---|" + "---|" * (len(widths) + 1),
    ]
    for (opt, param), entries in optimum_moves(rows, widths).items():
        at = {w: _lr(e, edge) for w, e, edge in entries}
        moved = "-"
        if len(entries) > 1 and entries[0][0] == widths[0]:
            moved = f"{entries[-1][1] - entries[0][1]:+d}" + ("*" if entries[-1][2] else "")
        lines.append(
            f"| {opt} | {param} | " + " | ".join(at.get(w, "") for w in widths) + f" | {moved} |"
        )
    lines += [
        "",
        "## Wall-clock cost per step",
        "",
        "The median over a width's points of each run's own median step time (compilation "
        "excluded), and its ratio to AdamW's at the same width. On a shared machine a run's "
        "times carry the load of whatever else ran beside it, which changes from run to run.",
        "",
        "| d_model | " + " | ".join(optimizers) + " |",
        "|---|" + "---|" * len(optimizers),
    ]
    for w in widths:
        times = {o: _median_step(rows, o, w) for o in optimizers}
        base = times.get("adamw")
        row = []
        for o in optimizers:
            t = times[o]
            ratio = f" ({t / base:.2f}x)" if t is not None and base else ""
            row.append("" if t is None else f"{t * 1000:.0f} ms{ratio}")
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    exponents = sorted({r["exponent"] for r in rows})
    lines += [
        "",
        "## Every point",
        "",
        "Final validation loss (- : diverged, stopped early; blank: not in the grid or not run).",
        "",
        "| optimizer | parametrization | d_model | " + " | ".join(_lr(e) for e in exponents) + " |",
        "|---|---|---|" + "---|" * len(exponents),
    ]
    for (opt, param, w), cell in sorted(cells.items()):
        values = [
            "" if e not in cell else "-" if cell[e]["loss"] is None else f"{cell[e]['loss']:.3f}"
            for e in exponents
        ]
        lines.append(f"| {opt} | {param} | {w} | " + " | ".join(values) + " |")
    return "\n".join(lines + ["", *READING, ""])


def _median_step(rows: list[dict], optimizer: str, width: int) -> float | None:
    times = sorted(
        r["step_s"]
        for r in rows
        if r["optimizer"] == optimizer and r["d_model"] == width and r.get("step_s")
    )
    if not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon", "lion": "Lion", "soap": "SOAP"}
READING = [
    "## What widths 64 to 256 on a CPU can and cannot say",
    "",
    "marin's study (Wen et al. 2025, arXiv 2509.02046) found Muon and SOAP about 1.4x faster "
    "than a well-tuned AdamW at 0.1B parameters and about 1.1x at 1.2B, with each optimizer "
    "tuned at every size and 1x to 8x the Chinchilla token budget.",
    "",
    "- **It can say** whether each optimizer's best learning rate stays put across a 4x range "
    "of width under muP and moves under SP (the octave table): that is what lets one tune "
    "each optimizer once, at the base width, and compare them tuned at every width.",
    "- **It can say** what each optimizer's update costs per step at these sizes, and why "
    "that overstates the cost at scale: Muon's Newton-Schulz iterations cost about "
    "ns_steps x 3 products of a d x 4d matrix per matrix, independent of the batch, against "
    "6 x tokens-per-step products for the forward and backward pass; with 1,024 tokens a step "
    "here the ratio grows like d / 200, while at 1M tokens a step it is a few per cent.",
    "- **It cannot say** whether the speedup shrinks with size as marin found. These models "
    "have 0.26M to 2.6M parameters (all embeddings included), 2-3 orders of magnitude below "
    "0.1B, and train on 112,640 tokens: well under one token per parameter, far from "
    "Chinchilla's 20, where the ranking measures how fast the loss first falls, not where it "
    "ends. A change of a few hundredths of a nat across three widths at one seed is within "
    "seed noise; the learning-rate grid is an octave wide, so a tuned point is only tuned "
    "to a factor of 2.",
    "- **Only the learning rate is tuned**, to an octave, for every optimizer: AdamW keeps "
    "b2 = 0.95, weight decay 0.1, 10 warmup steps and clipping at 1.0. marin found that tuning "
    "all of AdamW's hyperparameters shrank the speedups reported before them to 1.1-1.4x, so a "
    "speedup here is against a less tuned AdamW than theirs. Muon's AdamW group (embeddings, "
    "norms, the readout) takes Muon's learning rate, so tuning Muon also moves those "
    "parameters' rate away from where AdamW's tuning put it.",
    "- **The speedup is read inside one cosine schedule.** The loss a run passes on its way "
    "is not the final loss of a shorter run with its own decay (marin compares final losses "
    "across budgets), so tokens-to-reach understates what a schedule fitted to the shorter "
    "budget would do; rankings can change before the decay ends.",
    "- **No scaling-law fit.** `eqllm fit` needs several compute budgets; every point here "
    "has one token budget and three sizes per optimizer, too few for approach 3's five "
    "parameters. Marin-style speedups at scale come from such fits per optimizer: the "
    "command below, at several `train.steps`, gives their points.",
    "",
    "## Running it bigger, on accelerators",
    "",
    "The same two stages with larger widths, more depth and a real corpus, the first width the "
    "base (each `--set` is a fixed override of every point, as in `eqllm run --set`):",
    "",
    "```",
    "PYTHONPATH=. python benchmarks/studies.py optimizers --jobs 1 \\",
    "  --widths 256,512,1024,2048 --out runs/optimizers_gpu \\",
    "  --page docs/experiments/optimizers_gpu.md \\",
    "  --set model.overrides.n_layers=12 --set model.overrides.attention.n_heads=8 \\",
    "  --set model.overrides.attention.n_kv_heads=8 --set model.overrides.max_seq_len=1024 \\",
    "  --set data.seq_len=1024 --set train.batch_size=128 --set train.steps=4000 \\",
    "  --set optim.warmup_steps=400 --set train.eval_every=100 --set eval.batches=20 \\",
    "  --set train.checkpoint_every=1000 --set data.bpe_vocab_size=32000 \\",
    '  --set \'data.source={kind="hf", name="HuggingFaceFW/fineweb-edu", '
    'config="sample-10BT", max_bytes=4_000_000_000}\'',
    "```",
    "",
    "Add `--optimizers adamw,muon,lion,soap` for SOAP (left out of the CPU run: at width 256 "
    "one SOAP point compiled for 53 s against AdamW's 12 and stepped at 3.5x AdamW's median "
    "step time, under load, with the default soap_max_precond_dim). Shards on several hosts: run "
    "`eqllm sweep runs/optimizers_gpu/optimizers.toml --shard I/N` on each once the study has "
    "written stage two's file, then the command above with `--no-run` writes the page.",
]
