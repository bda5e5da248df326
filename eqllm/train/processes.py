"""Several processes, one run (`jax.distributed`): who writes the run folder, and when.

Every process runs the same steps, evaluations and checkpoint saves (orbax writes each
process's shards and process 0 the metadata). The run folder's other files (metrics.jsonl,
TensorBoard events, summary.json, report.md, samples, the recipe, tokenizer and model config)
are written by process 0 alone. With one process these are no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils


def writes_run_files() -> bool:
    """Whether this process writes the run folder's files (process 0 of the run)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of the run reaches the barrier called `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


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
