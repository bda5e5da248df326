"""Errors of run folders and their checkpoints: bad input, each naming the folder and the fix."""

from __future__ import annotations

from eqllm.errors import EqllmError


class RunFolderError(EqllmError):
    """A run folder or checkpoint that is missing, incomplete or does not fit the request."""


class MissingRunFile(RunFolderError, FileNotFoundError):
    """A run folder, checkpoint or file of one that does not exist."""


class CheckpointMismatch(RunFolderError):
    """A checkpoint's arrays do not match the model and optimizer state it is restored into."""


class UnverifiedCheckpoint(RunFolderError):
    """A checkpoint without the checksums that would show it intact; restored only with --force."""


class NewerRunFormat(RunFolderError):
    """A run folder written by a newer eqllm, in a format this one cannot read."""
