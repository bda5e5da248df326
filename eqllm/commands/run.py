"""`eqllm run RECIPE [--out DIR] [--set key=value ...] [--resume [--force]]`: train a recipe.

Exit status: 0 when the run finished, 130 / 143 when SIGINT / SIGTERM stopped it (with a
checkpoint to resume from), 1 when it stopped on a non-finite loss, a damaged checkpoint or a
checkpoint that could not be written or a lost process of a multi-process run, 2 for bad input
(`eqllm.cli`). In a multi-process run a signal to any process stops all of them after the same
step, each with that signal's status.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import jax

from eqllm.errors import EqllmError
from eqllm.recipe import load_recipe
from eqllm.train.console import split_console
from eqllm.train.guards import CheckpointWriteError, DamagedCheckpoint
from eqllm.train.loop import NonFiniteLoss, run
from eqllm.train.watchdog import Watchdog

LOST_AFTER = 60.0  # seconds without a heartbeat before a process counts as lost


def run_command(args: argparse.Namespace) -> int:
    """`eqllm run RECIPE_OR_PATH [--out DIR] [--set key=value ...] [--resume]`."""
    # First: jax.distributed must start before anything asks jax for its devices.
    join_processes(
        args.coordinator, args.num_processes, args.process_id, lost_after=args.lost_after
    )
    recipe = load_recipe(args.recipe, args.set or [])
    out = args.out
    if out is None and args.resume is False:
        out = Path("runs") / recipe.name
    progress = not args.no_progress
    if jax.process_count() == 1:
        return _run(args, recipe, out, progress)
    # Several processes: one console (process 0's), a log file per process in the run folder,
    # and a watchdog that stops this process when another is lost.
    folder = Path(out) if out is not None else Path("runs") / (recipe.name or "run")
    split_console(folder, jax.process_index())
    watchdog = Watchdog(folder / "checkpoints", lost_after=args.lost_after).start()
    failed = True
    try:
        status = _run(args, recipe, out, progress and jax.process_index() == 0)
        failed = status == 1
    except EqllmError as e:
        print(f"eqllm: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint, the others left waiting
        status = 130
    except Exception as e:
        traceback.print_exc()
        status = 1
        if isinstance(e, getattr(jax.errors, "JaxRuntimeError", RuntimeError)):
            # A collective failed, as it does at once when a peer's connection closes: most
            # likely a process was lost. The watchdog names it (and ends this process) once its
            # heartbeat has been silent for --lost-after seconds.
            watchdog.wait(args.lost_after + watchdog.grace)
    watchdog.close(failed=failed)
    if not failed:
        return status
    # A failed process leaves at once: JAX's shutdown barrier at exit would wait for the
    # others, which may be blocked in a collective it will never join. Process 0 (which
    # hosts the coordination service) first gives their watchdogs time to read why.
    if jax.process_index() == 0:
        time.sleep(watchdog.grace)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(args: argparse.Namespace, recipe, out, progress: bool) -> int:
    """The run and its exit status: 0, 130 / 143 (stopped by a signal), 1 (stopped)."""
    try:
        result = run(recipe, out, resume=args.resume, progress=progress, force=args.force)
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


def join_processes(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    lost_after: float = LOST_AFTER,
) -> None:
    """Start JAX's multi-host runtime when asked: by the flags, by JAX's environment variables,
    or by a cluster JAX detects itself (SLURM, Open MPI, Kubernetes, TPU pods) that runs
    several processes."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise EqllmError(
            "--coordinator, --num-processes and --process-id go together: give all three "
            "(or none, and let the environment variables or the cluster say)"
        )
    if lost_after <= 0:
        raise EqllmError(f"--lost-after={lost_after:g}: give a positive number of seconds")
    if not all(given) and not os.environ.get("JAX_COORDINATOR_ADDRESS") and not cluster_detected():
        return
    # CPU processes exchange collectives through gloo (the default from some jax version on;
    # "none" before, which fails the first cross-process step). GPUs use NCCL whatever it says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM in C++ and only records it; eqllm's loop
    # handles SIGTERM itself (every process stops after the same step, with a checkpoint).
    jax.config.update("jax_enable_preemption_service", False)
    # JAX's own heartbeat aborts a process whose peers are gone; eqllm's watchdog (which names
    # the lost process) fires first.
    timeouts = {"heartbeat_timeout_seconds": int(lost_after) + 30}
    if all(given):
        jax.distributed.initialize(coordinator, num_processes, process_id, **timeouts)
    else:
        jax.distributed.initialize(**timeouts)


def cluster_detected() -> str | None:
    """The name of the cluster environment `jax.distributed.initialize()` would detect, when it
    runs more than one process (None otherwise, or when JAX's detection cannot be asked)."""
    try:
        from jax._src.clusters import ClusterEnv

        for env in ClusterEnv._cluster_types:
            if not env.opt_in_only_method and env.is_env_present():
                return env.__name__ if env.get_process_count() > 1 else None
    except Exception:  # JAX's detection moved or failed: flags and variables still work
        return None
    return None


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
        "variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a cluster "
        "JAX detects (SLURM, Open MPI, Kubernetes), work without flags",
    )
    hosts.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    hosts.add_argument("--num-processes", type=int, help="how many processes take part")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    hosts.add_argument(
        "--lost-after",
        type=float,
        default=LOST_AFTER,
        metavar="SECONDS",
        help="a process silent this long is lost: the others stop with status 1 (default 60)",
    )
    parser.set_defaults(func=run_command)
