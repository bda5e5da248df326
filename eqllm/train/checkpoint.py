"""Checkpoints with orbax-checkpoint's CheckpointManager.

A checkpoint at step s is a folder `<dir>/<s>/` holding two items:

- ``state``: the model's trainable arrays and the optimizer state, saved as a flat dict keyed by
  pytree path (``model.blocks.attn.q_proj.weight``), so a checkpoint reads without the code
  that wrote it and a mismatched model is reported by name;
- ``meta``: JSON with the step, the data position, the seed, the recipe, a checksum of every
  array (checked on restore: see `eqllm.train.guards.fingerprints`) and anything else given.

orbax writes into a temporary folder and renames it (atomic), saves asynchronously and keeps the
last `keep` checkpoints. `save(..., wait=True)` and `wait()` surface errors from the background
write. `RunCheckpoints` is the training loop's view: it turns any failure to write into one
`CheckpointWriteError` that names the checkpoint still intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from eqllm.train.guards import (
    CheckpointMismatch,
    CheckpointWriteError,
    MissingRunFile,
    UnverifiedCheckpoint,
    fingerprints,
    save_error,
    verify_fingerprints,
)


def _flat(tree, prefix: str) -> dict[str, Any]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        key = prefix + jax.tree_util.keystr(path)
        flat[key.replace("[", ".").replace("]", "").replace("'", "")] = leaf
    return flat


def _state_tree(model, opt_state) -> dict[str, Any]:
    params = eqx.filter(model, eqx.is_inexact_array)
    return {**_flat(params, "model"), **_flat(opt_state, "opt_state")}


class Checkpointer:
    """Save and restore (model, opt_state, metadata) under `directory`, keeping the last `keep`."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, model, opt_state, meta: dict, *, wait: bool = False) -> Path:
        """Start saving checkpoint `step`; with `wait`, block until it is on disk."""
        tree = _state_tree(model, opt_state)
        meta = {**meta, "step": step, "fingerprints": fingerprints(tree)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        if wait:
            self.wait()
        return self.directory / str(step)

    def wait(self) -> None:
        """Block until background saves finish; their errors are raised here."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        return dict(
            self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        )

    def restore(self, model, opt_state, step: int | None = None, *, verify: bool = True):
        """(model, opt_state, meta) of checkpoint `step` (default latest), shaped like the inputs.

        `model` and `opt_state` are templates (e.g. freshly initialised); their arrays are
        replaced by the saved ones. A template that does not match the checkpoint is an error
        naming the differing arrays. The arrays are checked against the checksums saved with
        them; a checkpoint without checksums is refused unless `verify` is False.
        """
        step = self._step(step)
        template = _state_tree(model, opt_state)
        abstract = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=getattr(v, "sharding", None))
            for k, v in template.items()
        }
        try:
            saved_meta = self.read_meta(step)
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
            )["state"]
        except (ValueError, KeyError) as e:
            raise CheckpointMismatch(
                f"checkpoint {self.directory / str(step)} does not match this model/optimizer "
                f"(was the recipe changed?): {e}"
            ) from None
        missing = sorted(set(template) - set(restored))
        if missing:
            raise CheckpointMismatch(
                f"checkpoint {self.directory / str(step)} lacks arrays {missing[:5]}"
            )
        expected = saved_meta.get("fingerprints") or {}
        unchecked = sorted(set(template) - set(expected))
        if verify and unchecked:
            raise UnverifiedCheckpoint(
                f"checkpoint {self.directory / str(step)} has no checksums for arrays "
                f"{unchecked[:3]}{' ...' if len(unchecked) > 3 else ''}, so it cannot be shown "
                "intact; resume with --force to restore it unverified"
            )
        garbled = verify_fingerprints(restored, expected)
        if garbled:
            raise CheckpointMismatch(
                f"checkpoint {self.directory / str(step)}: arrays {garbled[:5]} do not match the "
                "checksums written with them (the files were changed or damaged)"
            )
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params = _unflat(params, "model", restored)
        opt_state = _unflat(opt_state, "opt_state", restored)
        return eqx.combine(params, static), opt_state, saved_meta

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise MissingRunFile(
                f"no checkpoint in {self.directory}; train with `eqllm run` first, or give the "
                "folder that holds the run's checkpoints"
            )
        if step is None:
            return self.latest_step()
        if step not in steps:
            raise MissingRunFile(
                f"no checkpoint step {step} in {self.directory}; it holds steps {steps}: give "
                "one of those (or no step, for the latest)"
            )
        return step

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _unflat(tree, prefix: str, flat: dict[str, Any]):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = _flat_keys(leaves_with_path, prefix)
    leaves = []
    for key, (_, leaf) in zip(keys, leaves_with_path, strict=True):
        if leaf is None:
            leaves.append(None)
            continue
        value = flat[key]
        if np.shape(value) != np.shape(leaf):
            raise CheckpointMismatch(
                f"checkpoint array {key} has shape {np.shape(value)}, the model expects "
                f"{np.shape(leaf)} (was the recipe changed?)"
            )
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _flat_keys(leaves_with_path, prefix: str) -> list[str]:
    return [
        (prefix + jax.tree_util.keystr(p)).replace("[", ".").replace("]", "").replace("'", "")
        for p, _ in leaves_with_path
    ]


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
