"""The optimizer study of docs/experiments/optimizers.md: its sweep, in two stages, and its page.

Stage one sweeps each optimizer's learning rate at the base width (muP and SP are the same model
there: every muP multiplier is 1.0 at d_model = base_d_model). Stage two carries each optimizer's
best base learning rate to the wider models and sweeps a few octaves around it, under muP (where
the optimum should stay) and under SP (where it should fall with width). Both stages are one sweep
file, recipes/sweeps/optimizers.toml (stage two appends its points to stage one's, so the points
that ran keep their folders), run by `eqllm sweep` into one folder. `benchmarks/studies.py
optimizers` drives it; the page writer here reads only study.jsonl (one row per finished point
with its validation-loss curve and step time), so it is tested on a fabricated file.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

# Learning-rate exponents (lr = 2^e) swept at the base width: five octaves around where each
# optimizer's step size puts its optimum (Muon under "match_rms_adamw" matches AdamW's update
# RMS, so AdamW's range; Lion's sign update is larger per element, so lower; SOAP is Adam).
BASE_EXPONENTS = {
    "adamw": (-10, -9, -8, -7, -6),
    "muon": (-10, -9, -8, -7, -6),
    "lion": (-12, -11, -10, -9, -8),
    "soap": (-10, -9, -8, -7, -6),
}
# The wider widths get three octaves around the transferred optimum (`transfer_points`): muP
# should keep it, so one either side; SP's optimum falls with width (Adam's hidden step wants
# lr / m), so it and two below.
# What every point shares (the muTransfer study's setup, docs/experiments/mutransfer.md), with
# a validation loss every 10 steps (the speedup reads the curve) on 5 held-out batches.
FIXED = {
    "train.steps": 110,
    "train.batch_size": 8,
    "optim.warmup_steps": 10,
    "train.log_every": 5,
    "train.eval_every": 10,
    "eval.batches": 5,
    "train.checkpoint_every": 55,
    "eval.sample_tokens": 0,
    "model.overrides.n_layers": 2,
    "model.overrides.attention.n_heads": 4,
    "model.overrides.attention.n_kv_heads": 4,
}
# SOAP's eigenbases are refreshed by a QR of each side; a side longer than this keeps the
# identity (the vocabulary and d_ff axes), which keeps SOAP's step affordable on a CPU.
SOAP_MAX_PRECOND_DIM = 256


def point(optimizer: str, parametrization: str, width: int, exponent: int) -> dict:
    """One point's overrides (d_ff follows the width, 4 x d_model)."""
    settings = {
        "optim.name": optimizer,
        "model.overrides.parametrization": parametrization,
        "model.overrides.d_model": width,
        "model.overrides.mlp.d_ff": 4 * width,
        "optim.lr": 2.0**exponent,
    }
    if optimizer == "soap":
        settings["optim.soap_max_precond_dim"] = SOAP_MAX_PRECOND_DIM
    return settings


def base_points(optimizers: list[str], width: int) -> list[dict]:
    return [point(o, "mup", width, e) for o in optimizers for e in BASE_EXPONENTS[o]]


def transfer_points(optimizers: list[str], widths: list[int], best: dict[str, int]) -> list[dict]:
    """The wider widths' points around each optimizer's best base exponent, the most telling
    first (so a sweep stopped early still has them): muP at the transferred learning rate at
    every width, then the widest width's other points (muP an octave either side, SP at the
    transferred rate and two octaves below), then the next widest's."""
    first = [point(o, "mup", w, best[o]) for w in widths for o in optimizers]
    rest = [
        point(o, param, w, best[o] + d)
        for w in reversed(widths)
        for param, offsets in (("mup", (-1, 1)), ("sp", (-1, -2, 0)))
        for d in offsets
        for o in optimizers
    ]
    return first + rest


def sweep_toml(fixed: dict, points: list[dict], header: str) -> str:
    """A sweep file: recipe quickstart, [set] `fixed`, one [[points]] table per point."""
    lines = [*(f"# {line}" for line in header.splitlines()), 'recipe = "quickstart"', "", "[set]"]
    lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in fixed.items()]
    for settings in points:
        lines += ["", "[[points]]", *(f"{json.dumps(k)} = {_toml(v)}" for k, v in settings.items())]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def best_exponents(rows: list[dict], width: int) -> dict[str, int]:
    """Each optimizer's best (lowest final loss, diverged points left out) exponent at `width`."""
    best = {}
    for (opt, param, w), cells in cells_of(rows).items():
        if w == width and param == "mup":
            done = {e: r for e, r in cells.items() if r["loss"] is not None}
            if done:
                best[opt] = min(done, key=lambda e: done[e]["loss"])
    return best


def study_row(row: dict, metrics: list[dict], summary: dict) -> dict:
    """A results.jsonl row with its optimizer, lr exponent, validation curve (tokens, loss) and
    median step time: what the page needs, without the run folder."""
    curve = [
        [m["tokens"], m["val/loss"]]
        for m in metrics
        if "val/loss" in m and m["val/loss"] is not None and math.isfinite(m["val/loss"])
    ]
    return {
        **row,
        "optimizer": row["settings"].get("optim.name", "adamw"),
        "exponent": round(math.log2(row["lr"])),
        "curve": curve,
        "step_s": summary.get("step_s"),
    }


def cells_of(rows: list[dict]) -> dict[tuple[str, str, int], dict[int, dict]]:
    """(optimizer, parametrization, width) -> exponent -> row."""
    cells: dict[tuple[str, str, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        cells[r["optimizer"], r["parametrization"], r["d_model"]][r["exponent"]] = r
    return cells


def tokens_to_reach(curve: list[list[float]], target: float) -> float | None:
    """The tokens at which a loss curve first reaches `target`, linear between logged points
    (None when it never does)."""
    for i, (tokens, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(tokens)
            t0, l0 = curve[i - 1]
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
    return None


def best_row(cells: dict[int, dict]) -> dict | None:
    done = [r for r in cells.values() if r["loss"] is not None]
    return min(done, key=lambda r: r["loss"]) if done else None


def speedup(row: dict, baseline: dict) -> tuple[float | None, float]:
    """(tokens `row` needs to reach `baseline`'s final loss or None, the speedup: baseline's
    tokens to its own final loss over row's). A run that never reaches it gets the baseline's
    tokens to reach the run's final loss over the run's tokens (below 1)."""
    target = baseline["loss"]
    base_tokens = tokens_to_reach(baseline["curve"], target)
    tokens = tokens_to_reach(row["curve"], target)
    if tokens is not None:
        return tokens, base_tokens / tokens
    return None, tokens_to_reach(baseline["curve"], row["loss"]) / row["curve"][-1][0]


def optimum_moves(rows: list[dict], widths: list[int]) -> dict[tuple[str, str], list]:
    """(optimizer, parametrization) -> [(width, best exponent, at the grid's edge)] over the
    widths that have a finished point; the base width's points serve muP and SP alike."""
    cells = cells_of(rows)
    moves: dict[tuple[str, str], list] = {}
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for param in ("mup", "sp"):
            entries = []
            for w in widths:
                cell = cells.get((opt, param, w))
                if cell is None and w == widths[0]:
                    cell = cells.get((opt, "mup", w))
                best = best_row(cell) if cell else None
                if best is not None:
                    edge = best["exponent"] in (min(cell), max(cell))
                    entries.append((w, best["exponent"], edge))
            moves[opt, param] = entries
    return moves


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
        "base width's, in octaves (factors of 2).",
        "",
        "| optimizer | parametrization | "
        + " | ".join(f"d_model {w}" for w in widths)
        + " | octaves moved |",
        "|---|---|" + "---|" * (len(widths) + 1),
    ]
    for (opt, param), entries in optimum_moves(rows, widths).items():
        at = {w: _lr(e, edge) for w, e, edge in entries}
        moved = (
            f"{entries[-1][1] - entries[0][1]:+d}"
            if len(entries) > 1 and entries[0][0] == widths[0]
            else "-"
        )
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
    "- **The speedup is read inside one cosine schedule.** The loss a run passes on its way "
    "is not the final loss of a shorter run with its own decay (marin compares final losses "
    "across budgets), so tokens-to-reach understates what a schedule fitted to the shorter "
    "budget would do; rankings can change before the decay ends.",
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
    "Add `--optimizers adamw,muon,lion,soap` for SOAP (left out here: its QR refreshes made a "
    "width-256 step over 10x AdamW's on this CPU). Shards on several hosts: run "
    "`eqllm sweep runs/optimizers_gpu/optimizers.toml --shard I/N` on each once the study has "
    "written stage two's file, then the command above with `--no-run` writes the page.",
]
