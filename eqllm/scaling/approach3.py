"""Chinchilla approach 3, as refitted by Besiroglu et al. 2024 ("Chinchilla scaling: a
replication attempt"): L(N, D) = E + A / N^alpha + B / D^beta.

The fit minimises the Huber loss (delta 1e-3) between log L and
LSE(a - alpha ln N, b - beta ln D, e), with A = e^a, B = e^b, E = e^e, by L-BFGS (scipy) from a
grid of starting points, keeping the best; intervals come from refitting bootstrap resamples
of the points. Below ~1e5 parameters or ~100 steps a power law is not expected to hold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber
from threadpoolctl import threadpool_limits

from eqllm.scaling.results import FitError, Points

DELTA = 1e-3
NAMES = ("E", "A", "B", "alpha", "beta")
# The grid of Besiroglu et al.'s starting points. Every grid point is scored at once; L-BFGS
# starts from the best `STARTS` of them (each run costs a few hundred objective evaluations).
GRID = {
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
STARTS = 8
# The objective is divided by this so that L-BFGS's tolerances (relative to max(|f|, 1)) bite.
_SCALE = DELTA**2


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, params, tokens):
        n, d = np.asarray(params, np.float64), np.asarray(tokens, np.float64)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimum(self, flops, flops_per_param_token: float = 6.0):
        """(N_opt, D_opt) minimising L under C = k N D (k = 6 by default), in closed form."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        c = np.asarray(flops, np.float64) / flops_per_param_token
        n = g * c ** (self.beta / (self.alpha + self.beta))
        return n, c / n

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in NAMES}


@dataclass(frozen=True)
class Approach3:
    """The fitted law, its objective value and bootstrap intervals per parameter."""

    law: Law
    objective: float
    intervals: dict[str, tuple[float, float]]  # 2.5th and 97.5th percentiles
    n_bootstrap: int

    def to_json(self) -> dict:
        return {
            **self.law.to_json(),
            "objective": self.objective,
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "n_bootstrap": self.n_bootstrap,
        }


def _huber(r: np.ndarray) -> np.ndarray:
    return huber(DELTA, r) / _SCALE


def _lse(terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log-sum-exp over the first axis and the softmax weights (written out: scipy's wrappers
    cost more than the arithmetic at this size, and the objective is called thousands of times)."""
    top = terms.max(axis=0)
    ex = np.exp(terms - top)
    total = ex.sum(axis=0)
    return top + np.log(total), ex / total


def _objective(theta: np.ndarray, ln_n, ln_d, ln_loss) -> tuple[float, np.ndarray]:
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * ln_n, b - beta * ln_d, np.full_like(ln_n, e)])
    lse, w = _lse(terms)
    r = lse - ln_loss
    dr = np.clip(r, -DELTA, DELTA) / _SCALE  # the Huber loss's derivative
    w = w * dr
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] @ ln_n), -(w[1] @ ln_d)])
    return float(_huber(r).sum()), grad


def _grid_values(grid: np.ndarray, ln_n, ln_d, ln_loss) -> np.ndarray:
    """The objective at every row (a, b, e, alpha, beta) of `grid`, in one array operation."""
    a, b, e, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    e = np.broadcast_to(e, (len(grid), len(ln_n)))
    terms = np.stack([a - alpha * ln_n, b - beta * ln_d, e])
    return _huber(_lse(terms)[0] - ln_loss).sum(axis=1)


def _fit(points: Points, extra_starts=(), n_starts: int = STARTS) -> tuple[np.ndarray, float]:
    """L-BFGS from the `n_starts` best grid points (and `extra_starts`); the best result."""
    args = (np.log(points.params), np.log(points.tokens), np.log(points.loss))
    grid = grid_starts()
    best_rows = grid[np.argsort(_grid_values(grid, *args))[:n_starts]]
    best, best_value = None, np.inf
    for start in [*extra_starts, *best_rows]:
        # One BLAS thread: L-BFGS-B's 5-dimensional products gain nothing from threads, and
        # spinning BLAS threads made each step ten times slower on a busy machine (measured).
        with threadpool_limits(1):
            res = minimize(
                _objective,
                np.asarray(start, np.float64),
                args=args,
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8},
            )
        if np.isfinite(res.fun) and res.fun < best_value:
            best, best_value = res.x, float(res.fun) * _SCALE
    if best is None:
        raise FitError("approach 3 found no finite fit from any starting point")
    return best, best_value


def _law(theta: np.ndarray) -> Law:
    a, b, e, alpha, beta = (float(x) for x in theta)
    return Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


def grid_starts() -> np.ndarray:
    """The candidate starting points, rows of (a, b, e, alpha, beta)."""
    g = GRID
    return np.array(list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"])))


def fit_approach3(points: Points, *, bootstrap: int = 100, seed: int = 0) -> Approach3:
    """Fit L(N, D) to `points`; `bootstrap` resamples give 95% percentile intervals."""
    if len(points) < 5:
        raise FitError(
            f"approach 3 fits 5 parameters and needs at least 5 points; got {len(points)}"
        )
    if len(np.unique(points.params)) < 2 or len(np.unique(points.tokens)) < 2:
        raise FitError("approach 3 needs points at two or more sizes and token counts")
    theta, value = _fit(points)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(bootstrap):
        sample = points.take(rng.integers(0, len(points), len(points)))
        # A resample starts from the full fit and its own two best grid points.
        draws.append(_fit(sample, [theta], n_starts=2)[0])
    intervals = {}
    if draws:
        laws = [_law(t) for t in draws]
        for name in NAMES:
            values = np.array([getattr(law, name) for law in laws])
            lo, hi = np.percentile(values, [2.5, 97.5])
            intervals[name] = (float(lo), float(hi))
    return Approach3(_law(theta), value, intervals, bootstrap)
