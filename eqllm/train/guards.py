"""What keeps a run's work safe: checked resumes, verified checkpoints, atomic files, clear errors.

- `resume_changes(saved, recipe, force=)`: every field a resumed run changes, refused unless each
  is in `FORCE_OK` and `force` is given (fields in `ALWAYS_OK` do not change results).
- checkpoints carry a checksum of every array, checked on restore (`eqllm.runs.checksums`).
- `restore_intact(checkpointer, model, opt_state)`: the newest checkpoint that restores and
  verifies; damaged newer ones are reported and moved aside to `<step>.damaged` (never deleted),
  so the resumed run's own saves cannot overwrite or collect them; with several processes,
  process 0 alone moves them, the others wait for it.
- `save_error(...)`: the message for a checkpoint that could not be written (disk full,
  read-only folder), naming the folder, the cause, the checkpoint still intact, and the fix.

Bad input (a changed recipe, a missing or damaged run folder) raises `EqllmError` subclasses; a
checkpoint that cannot be written raises `CheckpointWriteError`, an `OSError`, because it wraps a
failure of the disk, not of the input.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eqllm.recipe import Recipe
from eqllm.runs import (
    CheckpointMismatch,
    MissingRunFile,
    RunFolderError,
    UnverifiedCheckpoint,
)
from eqllm.train.processes import barrier, gather, writes_run_files

# Fields whose change does not change what is computed: names, cache locations.
ALWAYS_OK = ("name", "description", "data.cache_dir", "data.workers", "train.compile_cache")
# Fields a resumed run may change with --force: length of training, cadence, evaluation.
FORCE_OK = (
    "train.steps",
    "train.tokens",
    "train.tokens_per_param",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.skip_nonfinite",
    "train.remat",
    # How the step is laid out on the devices: the same values up to summation order.
    "train.microbatches",
    "mesh.",
    "eval.",
)


class RunExists(RunFolderError, FileExistsError):
    """The output folder already holds a run with checkpoints (and --resume was not given)."""


class ResumeMismatch(RunFolderError):
    """A resumed run's recipe differs from the saved one in fields it may not change."""


class DamagedCheckpoint(RunFolderError):
    """No checkpoint of the run restores intact."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, folder not writable, ...).

    An `OSError`, not an `EqllmError`: the cause is the disk, not the input. The message names
    the folder, the cause, the intact checkpoint and the fix in one line; `eqllm run` prints it
    and exits with status 1, as for any run that stopped.
    """


@dataclasses.dataclass(frozen=True)
class Change:
    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


def _leaves(values: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(values, dict) and values:  # model.overrides too: one entry per setting
        out = {}
        for key, value in values.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): values}


def recipe_diff(old: Recipe, new: Recipe) -> list[Change]:
    """Every leaf field (model overrides one by one) whose value differs, in recipe order."""
    a, b = _leaves(old.to_dict()), _leaves(new.to_dict())
    missing = object()
    keys = list(a) + [k for k in b if k not in a]
    return [
        Change(k, a.get(k, "(unset)"), b.get(k, "(unset)"))
        for k in keys
        if a.get(k, missing) != b.get(k, missing)
    ]


def _matches(path: str, allowed: tuple[str, ...]) -> bool:
    return any(path == p or (p.endswith(".") and path.startswith(p)) for p in allowed)


def resume_changes(saved: Recipe, recipe: Recipe, *, force: bool, where: str) -> list[Change]:
    """The changes a resumed run may make, or `ResumeMismatch` listing those it may not.

    `where` names the saved recipe in messages (the run's config.toml).
    """
    changes = [c for c in recipe_diff(saved, recipe) if not _matches(c.path, ALWAYS_OK)]
    refused = [c for c in changes if not _matches(c.path, FORCE_OK)]
    if refused:
        lines = "; ".join(str(c) for c in refused)
        raise ResumeMismatch(
            f"--resume: the recipe differs from the one in {where} in fields a resumed run "
            f"cannot change, even with --force: {lines}. A resumed run must train the same "
            "model on the same data with the same optimizer, batch and seed; restore those "
            "values, or start a new run with another --out."
        )
    if changes and not force:
        lines = "; ".join(str(c) for c in changes)
        raise ResumeMismatch(
            f"--resume: the recipe differs from the one in {where}: {lines}. These fields may "
            "change on resume: pass --force to accept the changes (the run then no longer "
            "matches an uninterrupted run of either recipe), or restore the saved values."
        )
    return changes


# Restoring the newest intact checkpoint ---------------------------------------------------


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    # TensorStore appends a repr of its whole spec to a read error: the sentence before is enough.
    first = first.split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {first[:300]}"


def move_aside(path: Path) -> Path:
    """Rename a checkpoint folder to `<name>.damaged` (numbered if taken); never delete it."""
    target = path.with_name(path.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged{n}")
    os.replace(path, target)
    return target


# Failures that say nothing about the checkpoint's files: a bug, memory, or a read the system
# could not do now (a transient I/O error). They propagate and nothing is moved aside.
_NOT_DAMAGE = (
    MemoryError,
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    ImportError,
    NotImplementedError,
    RecursionError,
    UnverifiedCheckpoint,
)
# Errors of the file system that mean the checkpoint's files are missing: damage.
_MISSING = (errno.ENOENT, errno.ENOTDIR)


def is_damage(e: BaseException) -> bool:
    """Whether a failure to restore a checkpoint shows that its files are damaged.

    Checksum and shape mismatches, unreadable or missing files, undecodable data are damage;
    bugs, running out of memory and I/O errors other than a missing file are not.
    """
    if isinstance(e, _NOT_DAMAGE):
        return False
    os_error = _root_os_error(e)
    return os_error is None or os_error.errno in _MISSING


def restore_intact(
    checkpointer, model, opt_state, *, force: bool = False, echo: Callable[[str], None] = print
):
    """(model, opt_state, meta) of the newest checkpoint that restores and verifies.

    Each damaged newer checkpoint (`is_damage`) is reported through `echo` and moved aside to
    `<step>.damaged`; any other failure propagates, moving nothing. Raises `DamagedCheckpoint`
    (moving nothing) when none is intact. A checkpoint without checksums is refused
    (`UnverifiedCheckpoint`) unless `force`.

    With several processes every one tries each checkpoint and they compare outcomes: a
    checkpoint is damaged when it is damaged for any of them, and process 0 alone reports and
    moves it aside while the others wait for it (so no two processes rename the same folder).
    """
    steps = sorted(checkpointer.steps(), reverse=True)
    damaged: list[tuple[int, str]] = []
    for step in steps:
        result, failure = None, None
        try:
            result = checkpointer.restore(model, opt_state, step, verify=not force)
        except Exception as e:
            failure = e
        outcomes = gather(_outcome(failure))  # every process's, by index (one collective)
        if failure is not None and not is_damage(failure):
            raise failure
        if _FAILED in outcomes:
            raise RunFolderError(
                f"--resume: process {outcomes.index(_FAILED)} could not restore checkpoint "
                f"{checkpointer.directory / str(step)} (see its log); nothing was moved"
            )
        if _DAMAGED in outcomes:
            why = _describe(failure) if failure is not None else None
            if why is None:  # damaged as another process read it
                why = f"unreadable by process {outcomes.index(_DAMAGED)} (see its log)"
            damaged.append((step, why))
            continue
        if damaged:
            _move_damaged(checkpointer, damaged, step, echo)
        return result
    listing = "; ".join(f"step {s}: {why}" for s, why in damaged) or "none found"
    raise DamagedCheckpoint(
        f"--resume: no checkpoint in {checkpointer.directory} restores intact ({listing}). "
        "Nothing was moved or deleted. Restore the folder from a backup, or start a new run "
        "with another --out."
    )


_INTACT, _DAMAGED, _FAILED = 0, 1, 2


def _outcome(failure: BaseException | None) -> int:
    if failure is None:
        return _INTACT
    return _DAMAGED if is_damage(failure) else _FAILED


def _move_damaged(checkpointer, damaged: list[tuple[int, str]], step: int, echo) -> None:
    """Process 0 moves the damaged checkpoints aside and says so; every process then sees the
    folder as it left it."""
    if writes_run_files():
        for bad_step, why in damaged:
            folder = checkpointer.directory / str(bad_step)
            kept = move_aside(folder)
            echo(
                f"WARNING: checkpoint {folder} is damaged ({why}); it was moved aside to "
                f"{kept} (nothing deleted: inspect or remove it yourself). Resuming from the "
                f"previous intact checkpoint, step {step}: the steps after it are redone."
            )
    barrier("eqllm: damaged checkpoints moved aside")
    checkpointer.manager.reload()


# Save errors ------------------------------------------------------------------------------


def _root_os_error(e: BaseException) -> OSError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def save_error(e: BaseException, step: int, directory: Path, intact: int | None) -> str:
    """The message for checkpoint `step` failing to be written into `directory`."""
    os_error = _root_os_error(e)
    code = os_error.errno if os_error is not None else None
    if code == errno.ENOSPC:
        cause, fix = "the disk is full", "free space on that disk (or --out elsewhere)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = "the folder is not writable", "make it writable (or --out elsewhere)"
    else:
        cause, fix = _describe(e), "check the folder and its disk"
    kept = (
        f"the previous checkpoint, step {intact}, is intact"
        if intact is not None
        else "no earlier checkpoint exists"
    )
    return (
        f"could not write checkpoint step {step} into {directory}: {cause} ({_describe(e)}). "
        f"The run stopped; {kept}. Fix: {fix}, then continue with --resume."
    )


__all__ = [
    "ALWAYS_OK",
    "FORCE_OK",
    "Change",
    "CheckpointMismatch",
    "CheckpointWriteError",
    "DamagedCheckpoint",
    "MissingRunFile",
    "ResumeMismatch",
    "RunExists",
    "RunFolderError",
    "move_aside",
    "recipe_diff",
    "UnverifiedCheckpoint",
    "is_damage",
    "restore_intact",
    "resume_changes",
    "save_error",
]
