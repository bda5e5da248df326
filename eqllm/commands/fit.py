"""`eqllm fit RESULTS.jsonl [--json] [--holdout-largest]`: scaling-law fits of a results file.

Prints approach 2 (IsoFLOP parabolas: N_opt ~ C^a, D_opt ~ C^b) and approach 3
(L = E + A/N^alpha + B/D^beta with bootstrap intervals); writes fit_isoflop.png and
fit_law.png beside the results file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eqllm.scaling import describe, fit_points, plot_fit, read_results


def fit_command(args: argparse.Namespace) -> int:
    path = Path(args.results)
    points = read_results(path)
    result = fit_points(points, bootstrap=args.bootstrap, holdout_largest=args.holdout_largest)
    written = plot_fit(points, result, path.parent)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for line in describe(result):
            print(line)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_parser(commands) -> None:
    """Register `eqllm fit` on the CLI's subparsers."""
    p = commands.add_parser("fit", help="fit scaling laws (Chinchilla approaches 2 and 3)")
    p.add_argument("results", help="a JSON-lines file with params, tokens, flops, loss per line")
    p.add_argument("--json", action="store_true", help="print the fits as JSON")
    p.add_argument(
        "--holdout-largest",
        action="store_true",
        help="fit without the largest compute budget and predict its best loss",
    )
    p.add_argument(
        "--bootstrap", type=int, default=100, help="bootstrap resamples for intervals (0: none)"
    )
    p.set_defaults(func=fit_command)
