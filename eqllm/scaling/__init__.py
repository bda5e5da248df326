"""Scaling-law fits over results files (numpy and scipy only; no JAX).

`eqllm fit RESULTS.jsonl` reads points (params, tokens, flops, loss per line) and fits
Chinchilla's approach 2 (IsoFLOP parabolas) and approach 3 (a parametric law by Huber loss and
multi-start L-BFGS, with bootstrap intervals).
"""

from eqllm.scaling.approach2 import Approach2, Budget, fit_approach2, isoflop_profile
from eqllm.scaling.approach3 import Approach3, Law, fit_approach3
from eqllm.scaling.fit import describe, fit_points, plot_fit
from eqllm.scaling.results import FitError, Points, group_budgets, read_results

__all__ = [
    "Approach2",
    "Approach3",
    "Budget",
    "FitError",
    "Law",
    "Points",
    "describe",
    "fit_approach2",
    "fit_approach3",
    "fit_points",
    "group_budgets",
    "isoflop_profile",
    "plot_fit",
    "read_results",
]
