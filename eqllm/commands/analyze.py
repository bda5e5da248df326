"""`eqllm analyze RUN_DIR`: Hessian top eigenvalue and gradient noise scale at a checkpoint."""

from __future__ import annotations

import argparse

from eqllm.analyze import analyze_run, format_analysis


def analyze_command(args: argparse.Namespace) -> int:
    r = analyze_run(
        args.run_dir,
        step=args.step,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        iters=args.iters,
    )
    for line in format_analysis(r):
        print(line)
    print(f"wrote {r['written']}")
    return 0


def add_parser(commands) -> None:
    """Register `eqllm analyze` on the CLI's subparsers."""
    p = commands.add_parser(
        "analyze", help="Hessian top eigenvalue and gradient noise scale at a run's checkpoint"
    )
    p.add_argument("run_dir", help="the run folder (eqllm run --out)")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--batch-size", type=int, help="sequences (default: the recipe's batch)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--iters", type=int, default=20, help="power-iteration steps (HVPs)")
    p.set_defaults(func=analyze_command)
