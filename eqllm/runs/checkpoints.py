"""A run's checkpoints, with orbax-checkpoint's CheckpointManager.

A checkpoint at step s is a folder `<dir>/<s>/` holding two items:

- ``state``: the model's trainable arrays and the optimizer state, saved as a flat dict keyed by
  pytree path (``model.blocks.attn.q_proj.weight``, ``opt_state.0.mu...``), so a checkpoint
  reads without the code that wrote it and a mismatched model is reported by name;
- ``meta``: JSON with the step, the data position, the seed, the recipe, a checksum of every
  array (checked on restore: `eqllm.runs.checksums`) and anything else given.

orbax writes into a temporary folder and renames it (atomic), saves asynchronously and keeps the
last `keep` checkpoints. `save(..., wait=True)` and `wait()` surface errors from the background
write. `restore` reads the model and the optimizer state (resuming a run); `restore_model` reads
the model's arrays alone, so loading a trained model needs no optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from eqllm.runs.checksums import fingerprints, verify_fingerprints
from eqllm.runs.errors import CheckpointMismatch, MissingRunFile, UnverifiedCheckpoint

ITEMS = ("state", "meta")


def _flat(tree, prefix: str) -> dict[str, Any]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        flat[_key(prefix, path)] = leaf
    return flat


def _key(prefix: str, path) -> str:
    key = prefix + jax.tree_util.keystr(path)
    return key.replace("[", ".").replace("]", "").replace("'", "")


def _state_tree(model, opt_state) -> dict[str, Any]:
    params = eqx.filter(model, eqx.is_inexact_array)
    return {**_flat(params, "model"), **_flat(opt_state, "opt_state")}


def _abstract(template: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=getattr(v, "sharding", None))
        for k, v in template.items()
    }


class Checkpointer:
    """Save and restore (model, opt_state, metadata) under `directory`, keeping the last `keep`.

    `read_only` opens an existing folder to read (nothing is created, nothing deleted).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise MissingRunFile(
                f"no checkpoint folder {self.directory}; train with `eqllm run` first, or give "
                "the folder that holds the run's checkpoints"
            )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # Reading: nothing is created, and nothing saved, so nothing is collected (orbax's
                # own read_only option warns on every open).
                max_to_keep=None if read_only else keep,
                create=not read_only,
                enable_async_checkpointing=async_save and not read_only,
            ),
            item_names=ITEMS,
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
        args = ocp.args.StandardRestore(_abstract(template))
        restored, meta = self._read(step, template, args, verify=verify)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params = _unflat(params, "model", restored)
        opt_state = _unflat(opt_state, "opt_state", restored)
        return eqx.combine(params, static), opt_state, meta

    def restore_model(self, model, step: int | None = None, *, verify: bool = True):
        """(model, meta) of checkpoint `step` (default latest): the model's arrays only, the
        optimizer state left on disk (no optimizer is built to read it)."""
        step = self._step(step)
        template = _flat(eqx.filter(model, eqx.is_inexact_array), "model")
        abstract = _abstract(template)
        restore_args = {
            k: ocp.ArrayRestoreArgs(
                sharding=s.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                global_shape=s.shape,
                dtype=s.dtype,
            )
            for k, s in abstract.items()
        }
        args = ocp.args.PyTreeRestore(
            item=abstract, restore_args=restore_args, partial_restore=True
        )
        restored, meta = self._read(step, template, args, verify=verify)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return eqx.combine(_unflat(params, "model", restored), static), meta

    def _read(self, step: int, template: dict, args, *, verify: bool) -> tuple[dict, dict]:
        """The arrays of `template` from checkpoint `step`, checked; and its meta."""
        where = self.directory / str(step)
        try:
            meta = self.read_meta(step)
            restored = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        except (ValueError, KeyError) as e:
            raise CheckpointMismatch(
                f"checkpoint {where} does not match this model/optimizer (was the recipe "
                f"changed?): {e}"
            ) from None
        missing = sorted(set(template) - set(restored))
        if missing:
            raise CheckpointMismatch(f"checkpoint {where} lacks arrays {missing[:5]}")
        expected = meta.get("fingerprints") or {}
        unchecked = sorted(set(template) - set(expected))
        if verify and unchecked:
            raise UnverifiedCheckpoint(
                f"checkpoint {where} has no checksums for arrays "
                f"{unchecked[:3]}{' ...' if len(unchecked) > 3 else ''}, so it cannot be shown "
                "intact; resume with --force to restore it unverified"
            )
        garbled = verify_fingerprints(restored, expected)
        if garbled:
            raise CheckpointMismatch(
                f"checkpoint {where}: arrays {garbled[:5]} do not match the checksums written "
                "with them (the files were changed or damaged)"
            )
        return restored, meta

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
    leaves = []
    for path, leaf in leaves_with_path:
        if leaf is None:
            leaves.append(None)
            continue
        key = _key(prefix, path)
        value = flat[key]
        if np.shape(value) != np.shape(leaf):
            raise CheckpointMismatch(
                f"checkpoint array {key} has shape {np.shape(value)}, the model expects "
                f"{np.shape(leaf)} (was the recipe changed?)"
            )
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)
