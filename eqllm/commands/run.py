"""`eqllm run RECIPE [--out DIR] [--set key=value ...] [--resume [--force]]`: train a recipe.

Exit status: 0 when the run finished, 130 / 143 when SIGINT / SIGTERM stopped it (with a
checkpoint to resume from), 1 when it stopped on a non-finite loss, a damaged checkpoint or a
checkpoint that could not be written, 2 for bad input (`eqllm.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

from eqllm.errors import EqllmError
from eqllm.recipe import load_recipe
from eqllm.train.guards import CheckpointWriteError, DamagedCheckpoint
from eqllm.train.loop import NonFiniteLoss, run


def run_command(args: argparse.Namespace) -> int:
    """`eqllm run RECIPE_OR_PATH [--out DIR] [--set key=value ...] [--resume]`."""
    # First: jax.distributed must start before anything asks jax for its devices.
    join_processes(args.coordinator, args.num_processes, args.process_id)
    recipe = load_recipe(args.recipe, args.set or [])
    out = args.out
    if out is None and args.resume is False:
        out = Path("runs") / recipe.name
    try:
        result = run(
            recipe, out, resume=args.resume, progress=not args.no_progress, force=args.force
        )
    except (NonFiniteLoss, DamagedCheckpoint, CheckpointWriteError) as e:
        # The run stopped after it started: exit 1, unlike bad input caught by the CLI (2).
        # CheckpointWriteError is an OSError (the disk failed, not the input), caught here by
        # name so that its one-line message (folder, cause, intact checkpoint, fix) is printed.
        print(f"eqllm: error: {e}", file=sys.stderr)
        return 1
    if result.interrupted == "SIGINT":
        return 130
    if result.interrupted == "SIGTERM":
        return 143
    return 0


def join_processes(coordinator: str | None, num_processes: int | None, process_id: int | None):
    """Start JAX's multi-host runtime when asked (flags or JAX's environment variables)."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise EqllmError(
            "--coordinator, --num-processes and --process-id go together: give all three "
            "(or none, and let the environment variables say)"
        )
    if not all(given) and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return
    # CPU processes exchange collectives through gloo (the default from some jax version on;
    # "none" before, which fails the first cross-process step). GPUs use NCCL whatever it says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if all(given):
        jax.distributed.initialize(coordinator, num_processes, process_id)
    else:
        jax.distributed.initialize()


def add_parser(commands) -> None:
    """Register `eqllm run` on the CLI's subparsers."""
    parser = commands.add_parser("run", help="train a recipe and write a run folder")
    parser.add_argument("recipe", help="a shipped recipe name (recipes/NAME.toml) or a path")
    parser.add_argument("--out", type=Path, default=None, help="run folder (runs/<recipe>)")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set train.steps=100 (repeatable)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept changes to the length of training, cadence and evaluation",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    hosts = parser.add_argument_group(
        "several hosts",
        "join a multi-host run (jax.distributed.initialize); the environment "
        "variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or SLURM, "
        "Open MPI) work too",
    )
    hosts.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    hosts.add_argument("--num-processes", type=int, help="how many processes take part")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    parser.set_defaults(func=run_command)
