"""A run's checkpoints as the training loop uses them (the format itself: `eqllm.runs`).

`RunCheckpoints` saves in the background and turns any failure to write into one
`CheckpointWriteError` that names the checkpoint still intact.
"""

from __future__ import annotations

import os

import equinox as eqx
import jax
import numpy as np

from eqllm.runs import Checkpointer
from eqllm.train.guards import CheckpointWriteError, save_error


class RunCheckpoints:
    """A run's checkpoints as the loop uses them: background saves, errors as
    `CheckpointWriteError` naming the folder, the cause and the checkpoint still intact.

    Attributes:
        last_saved: the step of the newest checkpoint saved (or restored), None before any.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int):
        self.checkpointer = Checkpointer(directory, keep=keep)
        self.directory = self.checkpointer.directory
        self.last_saved: int | None = None

    def save(self, step: int, model, opt_state, meta: dict, *, wait: bool = False) -> None:
        """Start saving checkpoint `step` (after the previous save finished); `wait`: block."""
        if jax.devices()[0].platform == "cpu":
            # The next step donates these buffers; on CPU hand orbax host copies of its own.
            model = jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, model)
            opt_state = jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, opt_state)
        self.wait()  # the previous (background) save: its errors surface here
        try:
            self.checkpointer.save(step, model, opt_state, meta, wait=wait)
        except Exception as e:  # disk full, read-only folder, ...
            self._raise(e, step)
        self.last_saved = step

    def wait(self) -> None:
        """Block until the background save finished; raise `CheckpointWriteError` if it failed."""
        try:
            self.checkpointer.wait()
        except Exception as e:
            self._raise(e, self.last_saved)

    def close(self, *, failing: bool = False) -> None:
        """Finish the background save and close; with `failing` (an error already in flight,
        the one to report) a failure here is not raised."""
        try:
            self.checkpointer.close()
        except Exception as e:
            if not failing:
                self._raise(e, self.last_saved)

    def _raise(self, e: Exception, step: int | None):
        self.checkpointer.manager.reload()
        intact = self.checkpointer.latest_step()
        raise CheckpointWriteError(save_error(e, step, self.directory, intact)) from e
