"""Chinchilla approach 2 (Hoffmann et al. 2022, section 3.2): IsoFLOP profiles.

Points of one compute budget (FLOPs within 10%) trace loss against model size; a parabola in
log N through them gives the budget's optimal size N_opt (and one in log D the optimal tokens
D_opt). Lines through (log C, log N_opt) and (log C, log D_opt) give N_opt ~ C^a, D_opt ~ C^b.
A parabola fitted on a wide or off-centre grid is biased (Besiroglu et al. 2024): keep sizes
centred on the optimum, a factor of a few either side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eqllm.scaling.results import FitError, Points, group_budgets


@dataclass(frozen=True)
class Budget:
    """One IsoFLOP profile: its compute, the parabolas' optima and their coefficients."""

    flops: float  # geometric mean of the group's FLOPs
    n_points: int
    params_opt: float
    tokens_opt: float
    loss_opt: float  # the parabola's minimum in log N
    coef_params: tuple[float, float, float]  # loss = c0 x^2 + c1 x + c2, x = ln N
    coef_tokens: tuple[float, float, float]  # the same in x = ln D


@dataclass(frozen=True)
class Approach2:
    """N_opt = kn C^a and D_opt = kd C^b over the budgets with a usable profile."""

    a: float
    b: float
    kn: float
    kd: float
    budgets: tuple[Budget, ...]

    def params_opt(self, flops):
        return self.kn * np.asarray(flops, dtype=np.float64) ** self.a

    def tokens_opt(self, flops):
        return self.kd * np.asarray(flops, dtype=np.float64) ** self.b

    def to_json(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "kn": self.kn,
            "kd": self.kd,
            "budgets": [
                {
                    "flops": b.flops,
                    "n_points": b.n_points,
                    "params_opt": b.params_opt,
                    "tokens_opt": b.tokens_opt,
                    "loss_opt": b.loss_opt,
                }
                for b in self.budgets
            ],
        }


def isoflop_profile(points: Points) -> Budget | None:
    """The parabolas of one budget's points; None with fewer than 3 sizes or no minimum."""
    if len(np.unique(points.params)) < 3:
        return None
    x, d = np.log(points.params), np.log(points.tokens)
    cn = np.polyfit(x, points.loss, 2)
    cd = np.polyfit(d, points.loss, 2)
    if cn[0] <= 0 or cd[0] <= 0:  # no minimum: the sizes do not straddle the optimum
        return None
    xn, xd = -cn[1] / (2 * cn[0]), -cd[1] / (2 * cd[0])
    return Budget(
        flops=float(np.exp(np.mean(np.log(points.flops)))),
        n_points=len(points),
        params_opt=float(np.exp(xn)),
        tokens_opt=float(np.exp(xd)),
        loss_opt=float(np.polyval(cn, xn)),
        coef_params=tuple(float(c) for c in cn),
        coef_tokens=tuple(float(c) for c in cd),
    )


def profiles(points: Points, tolerance: float = 0.1) -> list[Budget]:
    """Every budget's IsoFLOP profile (budgets without a usable parabola left out)."""
    found = [isoflop_profile(points.take(g)) for g in group_budgets(points.flops, tolerance)]
    return [b for b in found if b is not None]


def fit_approach2(points: Points, tolerance: float = 0.1) -> Approach2:
    """Approach 2 over the budgets of `points` (needs at least two usable budgets)."""
    budgets = profiles(points, tolerance)
    if len(budgets) < 2:
        raise FitError(
            f"approach 2 needs at least 2 compute budgets (FLOPs within 10%) with 3 or more "
            f"sizes each around a minimum of loss; found {len(budgets)}: add sizes either side "
            "of each budget's best"
        )
    c = np.log([b.flops for b in budgets])
    a, ln_kn = np.polyfit(c, np.log([b.params_opt for b in budgets]), 1)
    b, ln_kd = np.polyfit(c, np.log([b.tokens_opt for b in budgets]), 1)
    return Approach2(float(a), float(b), float(np.exp(ln_kn)), float(np.exp(ln_kd)), tuple(budgets))
