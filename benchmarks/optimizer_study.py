"""The optimizer study of docs/experiments/optimizers.md: its sweep, in two stages, and its
arithmetic (the page itself: benchmarks/optimizer_page.py).

Stage one sweeps each optimizer's learning rate at the base width (muP and SP are the same model
there: every muP multiplier is 1.0 at d_model = base_d_model). Stage two carries each optimizer's
best base learning rate to the wider models and sweeps a few octaves around it, under muP (where
the optimum should stay) and under SP (where it should fall with width). Both stages are one sweep
file, recipes/sweeps/optimizers.toml (stage two appends its points to stage one's, so the points
that ran keep their folders; a best at the edge of the base grid adds one octave past it), run
by `eqllm sweep` into one folder. `benchmarks/studies.py optimizers` drives it; the page is
written from study.jsonl alone (one row per finished point with its validation-loss curve and
step time), so it is tested on a fabricated file.
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
    """Each optimizer's best (lowest final loss, diverged points left out) exponent of its
    BASE_EXPONENTS at `width`: what stage two transfers (extension points do not change it, so
    stage two's file stays the same once written)."""
    best = {}
    for (opt, param, w), cells in cells_of(rows).items():
        if w == width and param == "mup":
            done = {
                e: r for e, r in cells.items() if r["loss"] is not None and e in BASE_EXPONENTS[opt]
            }
            if done:
                best[opt] = min(done, key=lambda e: done[e]["loss"])
    return best


def extension_points(optimizers: list[str], width: int, best: dict[str, int]) -> list[dict]:
    """One octave past the base grid for an optimizer whose best is at the grid's edge (the
    optimum may lie beyond; the page stars a best still at an edge)."""
    points = []
    for o in optimizers:
        grid = BASE_EXPONENTS[o]
        if best[o] in (grid[0], grid[-1]):
            points.append(point(o, "mup", width, best[o] + (1 if best[o] == grid[-1] else -1)))
    return points


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
