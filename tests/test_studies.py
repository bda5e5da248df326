"""The optimizer study (benchmarks/optimizer_study.py) and its page writer (optimizer_page.py)
on a fabricated study.jsonl: speedups, octave moves and step costs against hand-computed values."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from eqllm.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    """A script of benchmarks/ as a module (it imports its neighbours by their bare names)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


study = _load("optimizer_study")
writer = _load("optimizer_page")


def row(opt, param, width, exponent, loss, curve=None, step_s=0.010):
    """A study.jsonl row; `curve` (tokens, validation loss) ends at the final loss."""
    curve = curve or [[100, 6.0], [200, 5.0], [300, loss or 9.0]]
    return {
        "point": f"{opt}-{param}-{width}-{exponent}",
        "settings": {"optim.name": opt},
        "lr": 2.0**exponent,
        "optimizer": opt,
        "exponent": exponent,
        "parametrization": param,
        "d_model": width,
        "n_layers": 2,
        "steps": 3,
        "tokens": 300,
        "loss": loss,
        "diverged": loss is None,
        "seconds": 1.0,
        "curve": curve,
        "step_s": step_s,
    }


ROWS = [
    # Base width 64 (muP there is SP): AdamW's best 2^-8 reaches 4.0 at 300 tokens.
    row("adamw", "mup", 64, -9, 4.3),
    row("adamw", "mup", 64, -8, 4.0),
    row("adamw", "mup", 64, -7, 4.2),
    # Muon passes 4.0 at 200 tokens: 300 / 200 = 1.5x; it costs 15 ms a step to AdamW's 10.
    row("muon", "mup", 64, -9, 4.1, step_s=0.015),
    row("muon", "mup", 64, -8, 3.8, [[100, 5.5], [200, 4.0], [300, 3.8]], step_s=0.015),
    row("muon", "mup", 64, -7, 3.9, step_s=0.015),
    # Lion ends at 4.5 and never reaches 4.0; AdamW passes 4.5 at 200 + 0.5 / 1.0 x 100 = 250
    # tokens: 250 / 300 = 0.83x. Its 2^-8 diverged.
    row("lion", "mup", 64, -11, 4.6),
    row("lion", "mup", 64, -10, 4.5),
    row("lion", "mup", 64, -8, None),
    # Width 128: AdamW keeps 2^-8 under muP (3.9 at 300 tokens); under SP its best is 2^-10,
    # the lowest of its grid (an edge): moved -2 octaves.
    row("adamw", "mup", 128, -9, 4.1),
    row("adamw", "mup", 128, -8, 3.9, [[100, 6.0], [200, 4.9], [300, 3.9]]),
    row("adamw", "mup", 128, -7, 4.0),
    row("adamw", "sp", 128, -10, 3.95),
    row("adamw", "sp", 128, -9, 4.05),
    row("adamw", "sp", 128, -8, 4.2),
    # Muon's muP best moves to 2^-7 and passes 3.9 at 200 + 0.4 / 0.8 x 100 = 250: 1.2x.
    row("muon", "mup", 128, -8, 3.7),
    row("muon", "mup", 128, -7, 3.5, [[100, 5.0], [200, 4.3], [300, 3.5]]),
    row("muon", "mup", 128, -6, 3.6),
]


def test_tokens_to_reach_interpolates_between_logged_points():
    curve = [[100, 6.0], [200, 5.0], [300, 4.0]]
    assert study.tokens_to_reach(curve, 4.5) == pytest.approx(250.0)
    assert study.tokens_to_reach(curve, 6.5) == 100.0  # already below at the first point
    assert study.tokens_to_reach(curve, 3.9) is None


def test_page_reports_speedups_octaves_and_costs_computed_by_hand(tmp_path):
    path = tmp_path / "study.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert study.best_exponents(rows, 64) == {"adamw": -8, "muon": -8, "lion": -10}
    page = writer.page(
        rows,
        [64, 128],
        ["adamw", "muon", "lion"],
        total=24,
        command="CMD",
        machine=["- machine: test"],
    )
    assert "Regenerate: `CMD`" in page
    assert "- 18 of 24 points finished (6 not run yet: blank cells below), 1 diverged" in page
    # Speedups: | d_model | optimizer | best lr | final loss | tokens | speedup |
    assert "| 64 | adamw | 2^-8 | 4.0000 | 300 | 1.00x |" in page
    assert "| 64 | muon | 2^-8 | 3.8000 | 200 | 1.50x |" in page
    assert "| 64 | lion | 2^-10 | 4.5000 | - | 0.83x |" in page
    assert "| 128 | muon | 2^-7 | 3.5000 | 250 | 1.20x |" in page
    assert "- muon: 1.50x at 64, 1.20x at 128" in page
    # Octaves: the base width's points serve SP too; an edge best is starred.
    assert "| adamw | mup | 2^-8 | 2^-8 | +0 |" in page
    assert "| adamw | sp | 2^-8 | 2^-10* | -2* |" in page
    assert "| muon | mup | 2^-8 | 2^-7 | +1 |" in page
    assert "| lion | mup | 2^-10 |  | - |" in page  # no wider point yet
    # Step cost: median step time and the ratio to AdamW's at the same width.
    assert "| 64 | 10 ms (1.00x) | 15 ms (1.50x) | 10 ms (1.00x) |" in page
    # The grid: a diverged point is "-".
    assert "| lion | mup | 64 | 4.600 | 4.500 |  | - |  |  |" in page


def test_transfer_points_sweep_around_each_best_and_load_as_a_sweep(tmp_path):
    points = study.transfer_points(["adamw", "lion"], [128, 256], {"adamw": -8, "lion": -10})
    assert len(points) == 2 * 2 * 6
    # muP at the transferred rate at every width comes first, then the widest width's others.
    assert [(p["model.overrides.parametrization"], p["optim.lr"]) for p in points[:4]] == [
        ("mup", 2.0**-8),
        ("mup", 2.0**-10),
    ] * 2
    assert {p["model.overrides.d_model"] for p in points[4:14]} == {256}
    lion_sp = sorted(
        round(math.log2(p["optim.lr"]))
        for p in points
        if p["optim.name"] == "lion"
        and p["model.overrides.parametrization"] == "sp"
        and p["model.overrides.d_model"] == 256
    )
    assert lion_sp == [-12, -11, -10]
    fixed = {**study.FIXED, "model.overrides.base_d_model": 64}
    spec = tmp_path / "optimizers.toml"
    spec.write_text(study.sweep_toml(fixed, study.base_points(["lion"], 64) + points, "x"))
    sweep = load_sweep(spec)
    assert [p.settings for p in sweep.points[5:]] == points
    recipe = sweep.point_recipe(sweep.points[-1])
    assert recipe.optim.name == "lion" and recipe.model.overrides["d_model"] == 128


def test_a_best_at_the_base_grids_edge_gets_one_octave_more_without_moving_stage_two():
    """Muon's base grid ends at 2^-6; a best there adds 2^-5, which stage two does not follow
    (its file, written once, must not change under the points it holds)."""
    rows = [row("muon", "mup", 64, -7, 4.1), row("muon", "mup", 64, -6, 4.0)]
    best = study.best_exponents(rows, 64)
    assert best == {"muon": -6}
    assert study.extension_points(["muon"], 64, best) == [study.point("muon", "mup", 64, -5)]
    rows.append(row("muon", "mup", 64, -5, 3.9))  # better, but outside the base grid
    assert study.best_exponents(rows, 64) == {"muon": -6}
    assert study.extension_points(["adamw"], 64, {"adamw": -8}) == []
