"""Several processes, one run (`jax.distributed`): who writes the run folder, and when.

Every process runs the same steps, evaluations and checkpoint saves (orbax writes each
process's shards and process 0 the metadata). The run folder's other files (metrics.jsonl,
TensorBoard events, summary.json, report.md, samples, the recipe, tokenizer and model config)
are written by process 0 alone. Decisions that must be the same everywhere (stop now, this
checkpoint is damaged) are taken together (`gather`) or by process 0 and shared
(`share_from_zero`). With one process these are no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

# Why a run stops early, as codes an all-gather can carry (0: no reason).
STOP_REASONS = ("SIGINT", "SIGTERM")


def writes_run_files() -> bool:
    """Whether this process writes the run folder's files (process 0 of the run)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of the run reaches the barrier called `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather(value: int) -> list[int]:
    """`value` of every process, by process index (every process must call it, in the same
    order as its other collectives)."""
    if jax.process_count() == 1:
        return [int(value)]
    values = multihost_utils.process_allgather(np.asarray(value, dtype=np.int32))
    return [int(v) for v in np.asarray(values).ravel()]


def share_from_zero(value: int) -> int:
    """Process 0's `value`, on every process: the others wait here for its decision."""
    if jax.process_count() == 1:
        return int(value)
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, dtype=np.int32)))


def agree_on_stop(received: str | None) -> tuple[str | None, int | None]:
    """(signal, process index) of the lowest-indexed process that received SIGINT/SIGTERM, the
    same answer on every process, or (None, None); `received` is this process's own.

    A signal reaches one process (a scheduler may signal any of them): checking it together
    after every step makes all of them stop after the same step and save one checkpoint,
    instead of one leaving the collectives the others wait in.
    """
    code = 0 if received is None else 1 + STOP_REASONS.index(received)
    for index, c in enumerate(gather(code)):
        if c:
            return STOP_REASONS[c - 1], index
    return None, None


@contextlib.contextmanager
def process_zero_first(name: str) -> Iterator[None]:
    """Run the block in process 0 before the others: a cache it fills is then only read by
    them, not written by several processes at once."""
    first = writes_run_files()
    if not first:
        barrier(name)
    yield
    if first:
        barrier(name)
