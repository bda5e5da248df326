"""Both fits of a results file, the held-out prediction of the largest budget, and the plots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eqllm.scaling.approach2 import Approach2, fit_approach2, isoflop_profile
from eqllm.scaling.approach3 import Approach3, fit_approach3
from eqllm.scaling.results import FitError, Points, group_budgets


def fit_points(points: Points, *, bootstrap: int = 100, holdout_largest: bool = False) -> dict:
    """Approach 2 and 3 on `points`, as plain values (what `eqllm fit --json` prints).

    With `holdout_largest`, both are fitted without the largest compute budget and the result
    has a "holdout" entry: that budget's measured best loss against the approach-3 law's
    prediction at the same sizes and token counts (and the approach-2 N_opt against the
    budget's own parabola when it has one).
    """
    result: dict = {"n_points": len(points)}
    fitted = points
    if holdout_largest:
        groups = group_budgets(points.flops)
        if len(groups) < 2:
            raise FitError("--holdout-largest needs at least 2 compute budgets in the results")
        held = points.take(groups[-1])
        fitted = points.take(np.concatenate(groups[:-1]))
    try:
        a2: Approach2 | None = fit_approach2(fitted)
        result["approach2"] = a2.to_json()
    except FitError as e:
        a2 = None
        result["approach2"] = {"error": str(e)}
    a3 = fit_approach3(fitted, bootstrap=bootstrap)
    result["approach3"] = a3.to_json()
    if holdout_largest:
        predicted = a3.law.loss(held.params, held.tokens)
        best = int(np.argmin(held.loss))
        hold = {
            "flops": float(np.exp(np.mean(np.log(held.flops)))),
            "n_points": len(held),
            "measured_best_loss": float(held.loss[best]),
            "predicted_best_loss": float(predicted.min()),
            "error": float(predicted.min() - held.loss[best]),
            "relative_error": float((predicted.min() - held.loss[best]) / held.loss[best]),
        }
        profile = isoflop_profile(held)
        if a2 is not None and profile is not None:
            hold["params_opt_measured"] = profile.params_opt
            hold["params_opt_predicted"] = float(a2.params_opt(profile.flops))
        result["holdout"] = hold
    return result


def describe(result: dict) -> list[str]:
    """The fit as lines of text for the terminal."""
    lines = [f"{result['n_points']} points"]
    a2 = result["approach2"]
    if "error" in a2:
        lines.append(f"approach 2: not fitted: {a2['error']}")
    else:
        lines.append(
            f"approach 2 (IsoFLOP parabolas, {len(a2['budgets'])} budgets): "
            f"N_opt ~ C^{a2['a']:.3f}, D_opt ~ C^{a2['b']:.3f}"
        )
        for b in a2["budgets"]:
            lines.append(
                f"  C={b['flops']:.3g}: N_opt={b['params_opt']:.3g} D_opt={b['tokens_opt']:.3g} "
                f"loss={b['loss_opt']:.4f} ({b['n_points']} points)"
            )
    a3 = result["approach3"]
    lines.append("approach 3 (L = E + A/N^alpha + B/D^beta, Huber on log L, multi-start L-BFGS):")
    for name in ("E", "A", "B", "alpha", "beta"):
        interval = a3["intervals"].get(name)
        ci = f"  [{interval[0]:.4g}, {interval[1]:.4g}]" if interval else ""
        lines.append(f"  {name:5s} = {a3[name]:.4g}{ci}")
    if a3["intervals"]:
        lines.append(f"  (95% bootstrap intervals over {a3['n_bootstrap']} resamples)")
    hold = result.get("holdout")
    if hold:
        lines.append(
            f"held-out largest budget C={hold['flops']:.3g}: best loss measured "
            f"{hold['measured_best_loss']:.4f}, predicted {hold['predicted_best_loss']:.4f} "
            f"(error {hold['error']:+.4f}, {100 * hold['relative_error']:+.2f}%)"
        )
        if "params_opt_measured" in hold:
            lines.append(
                f"  N_opt: parabola {hold['params_opt_measured']:.3g}, approach 2 predicts "
                f"{hold['params_opt_predicted']:.3g}"
            )
    return lines


def plot_fit(points: Points, result: dict, directory: str | os.PathLike) -> list[Path]:
    """fit_isoflop.png (profiles and N_opt against C) and fit_law.png (approach 3 against the
    measured losses) in `directory`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    written = []
    groups = group_budgets(points.flops)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(1, len(groups))))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for g, color in zip(groups, colors, strict=True):
        p = points.take(g)
        c = float(np.exp(np.mean(np.log(p.flops))))
        left.scatter(p.params, p.loss, color=color, s=18, label=f"C={c:.2g}")
        profile = isoflop_profile(p)
        if profile is not None:
            x = np.linspace(np.log(p.params.min()), np.log(p.params.max()), 50)
            left.plot(np.exp(x), np.polyval(profile.coef_params, x), color=color, lw=1)
            left.scatter([profile.params_opt], [profile.loss_opt], color=color, marker="*", s=90)
    left.set(xscale="log", xlabel="parameters N", ylabel="loss", title="IsoFLOP profiles")
    left.legend(fontsize=7)
    a2 = result["approach2"]
    if "error" not in a2:
        c = np.array([b["flops"] for b in a2["budgets"]])
        right.scatter(c, [b["params_opt"] for b in a2["budgets"]], label="N_opt")
        right.scatter(c, [b["tokens_opt"] for b in a2["budgets"]], label="D_opt")
        span = np.geomspace(points.flops.min(), points.flops.max() * 3, 20)
        right.plot(span, a2["kn"] * span ** a2["a"], lw=1, label=f"N ~ C^{a2['a']:.2f}")
        right.plot(span, a2["kd"] * span ** a2["b"], lw=1, label=f"D ~ C^{a2['b']:.2f}")
        right.legend(fontsize=7)
    right.set(xscale="log", yscale="log", xlabel="training FLOPs C", title="approach 2")
    fig.tight_layout()
    path = directory / "fit_isoflop.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    a3 = result["approach3"]
    law_loss = (
        a3["E"] + a3["A"] / points.params ** a3["alpha"] + a3["B"] / points.tokens ** a3["beta"]
    )
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.scatter(points.loss, law_loss, s=14, c=np.log10(points.flops), cmap="viridis")
    lo, hi = points.loss.min(), points.loss.max()
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
    ax.set(
        xlabel="measured loss",
        ylabel="E + A/N^alpha + B/D^beta",
        title=f"approach 3: alpha={a3['alpha']:.2f}, beta={a3['beta']:.2f}, E={a3['E']:.2f}",
    )
    fig.tight_layout()
    path = directory / "fit_law.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


__all__ = ["Approach2", "Approach3", "describe", "fit_points", "plot_fit"]
