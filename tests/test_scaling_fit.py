"""Scaling-law fits recover the parameters of points drawn from a known law with noise."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eqllm.scaling import (
    FitError,
    Law,
    Points,
    fit_approach2,
    fit_approach3,
    fit_points,
    group_budgets,
    read_results,
)

# Hoffmann et al. 2022's approach-3 law (Besiroglu et al. 2024's refit is close to it).
TRUE = Law(E=1.82, A=482.0, B=2085.0, alpha=0.35, beta=0.37)


def synthetic(law: Law, budgets, *, noise: float, seed: int = 0, sizes: int = 9) -> Points:
    """IsoFLOP grids (C = 6 N D) centred on each budget's optimum, a factor 4 either side,
    with multiplicative log-normal noise on the loss."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in budgets:
        n_opt, _ = law.optimum(c)
        for n in n_opt * np.geomspace(0.25, 4, sizes):
            d = c / (6 * n)
            loss = float(law.loss(n, d)) * float(np.exp(rng.normal(0, noise)))
            # FLOPs jitter by a few percent inside a budget, as rounded sizes do.
            rows.append((n, d, c * rng.uniform(0.97, 1.03), loss))
    return Points.of(*zip(*rows, strict=True))


BUDGETS = np.geomspace(1e18, 1e22, 5)


def test_group_budgets_within_ten_percent():
    flops = np.array([1.0e12, 1.05e12, 3e12, 1.08e12, 3.2e12, 1e13])
    groups = [sorted(g.tolist()) for g in group_budgets(flops)]
    assert groups == [[0, 1, 3], [2, 4], [5]]


def test_approach3_recovers_the_law():
    points = synthetic(TRUE, BUDGETS, noise=0.003, seed=1)
    fit = fit_approach3(points, bootstrap=20)
    law = fit.law
    assert law.alpha == pytest.approx(TRUE.alpha, abs=0.03)
    assert law.beta == pytest.approx(TRUE.beta, abs=0.03)
    assert law.E == pytest.approx(TRUE.E, rel=0.03)
    # The bootstrap intervals are real intervals around the estimate.
    for name in ("E", "alpha", "beta"):
        lo, hi = fit.intervals[name]
        assert lo < hi
        assert lo - 0.05 <= getattr(law, name) <= hi + 0.05
    # Without noise the fit is (nearly) exact.
    exact = fit_approach3(synthetic(TRUE, BUDGETS, noise=0.0), bootstrap=0).law
    for name in ("E", "alpha", "beta"):
        assert getattr(exact, name) == pytest.approx(getattr(TRUE, name), rel=1e-3)


def test_approach2_recovers_the_exponents():
    # For C = 6 N D, N_opt ~ C^(beta / (alpha + beta)) and D_opt ~ C^(alpha / (alpha + beta)).
    a_true = TRUE.beta / (TRUE.alpha + TRUE.beta)
    points = synthetic(TRUE, BUDGETS, noise=0.002, seed=2)
    fit = fit_approach2(points)
    assert len(fit.budgets) == len(BUDGETS)
    assert fit.a == pytest.approx(a_true, abs=0.03)
    assert fit.b == pytest.approx(1 - a_true, abs=0.03)
    # Each budget's optimum lies near the law's own (parabola bias on a 16x grid is small).
    for budget, c in zip(fit.budgets, BUDGETS, strict=True):
        assert budget.params_opt == pytest.approx(TRUE.optimum(c)[0], rel=0.25)


def test_approach2_refuses_a_single_budget():
    with pytest.raises(FitError, match="at least 2 compute budgets"):
        fit_approach2(synthetic(TRUE, BUDGETS[:1], noise=0.0))


def test_holdout_largest_predicts_the_held_out_budget():
    points = synthetic(TRUE, BUDGETS, noise=0.002, seed=3)
    result = fit_points(points, bootstrap=0, holdout_largest=True)
    hold = result["holdout"]
    assert hold["n_points"] == 9
    assert abs(hold["relative_error"]) < 0.01
    assert hold["params_opt_predicted"] == pytest.approx(hold["params_opt_measured"], rel=0.3)


def test_read_results_skips_diverged_and_names_missing_keys(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [
        {"params": 1e6, "tokens": 1e8, "flops": 6e14, "loss": 3.0},
        {"params": 2e6, "tokens": 5e7, "flops": 6e14, "loss": float("nan")},
        {"params": 4e6, "tokens": 2.5e7, "flops": 6e14, "loss": 9.0, "diverged": True},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_results(path)) == 1
    path.write_text(json.dumps({"params": 1, "tokens": 2, "loss": 3}) + "\n")
    with pytest.raises(FitError, match="lacks flops"):
        read_results(path)


def test_fit_command_json_and_plots(tmp_path):
    points = synthetic(TRUE, BUDGETS[:3], noise=0.002, seed=4, sizes=7)
    path = tmp_path / "results.jsonl"
    with path.open("w") as f:
        for n, d, c, loss in zip(
            points.params, points.tokens, points.flops, points.loss, strict=True
        ):
            f.write(json.dumps({"params": n, "tokens": d, "flops": c, "loss": loss}) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqllm.cli",
            "fit",
            str(path),
            "--json",
            "--holdout-largest",
            "--bootstrap",
            "10",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert set(result["approach2"]) >= {"a", "b"}
    assert set(result["approach3"]) >= {"E", "A", "B", "alpha", "beta"}
    assert "predicted_best_loss" in result["holdout"]
    assert (tmp_path / "fit_isoflop.png").stat().st_size > 0
    assert (tmp_path / "fit_law.png").stat().st_size > 0
