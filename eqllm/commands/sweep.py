"""`eqllm sweep SWEEP.toml [--out DIR] [--jobs N] [--shard I/N]`: run a sweep of a recipe.

Exit status 0 when this shard's points all finished (diverged ones included), 130 / 143 when a
signal stopped it (run the same command again to resume), 1 when a worker failed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eqllm.sweep import load_sweep, parse_shard, run_sweep


def sweep_command(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep)
    shard = parse_shard(args.shard)
    out = Path(args.out) if args.out else Path("runs") / sweep.name
    stopped = run_sweep(sweep, out, jobs=args.jobs, shard=shard, progress=not args.no_progress)
    if stopped is None:
        return 0
    print(f"eqllm: sweep stopped ({stopped}); run the same command again to resume")
    return {"SIGINT": 130, "SIGTERM": 143}.get(stopped, 1)


def add_parser(commands) -> None:
    """Register `eqllm sweep` on the CLI's subparsers."""
    p = commands.add_parser("sweep", help="run a recipe over a grid of settings")
    p.add_argument("sweep", help="a sweep file (TOML: recipe, [set], [grid], [[points]])")
    p.add_argument("--out", help="the sweep folder (default runs/<sweep file name>)")
    p.add_argument("--jobs", type=int, default=1, help="points run at once (worker processes)")
    p.add_argument(
        "--shard", default="0/1", help="I/N: run every N-th point from the I-th (0-based)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=sweep_command)
