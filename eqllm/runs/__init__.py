"""The run folder: the format `eqllm run` writes, read and written here alone.

`RunFolder(path)` names a folder's files and reads them with nothing outside the folder (no
data, no caches, no optimizer, wherever it was moved): `load_model(step)`, `tokenizer()`,
`recipe()`, `heldout()`, `adapters()`, `read_meta(step)`. `Checkpointer` is the checkpoint
format (orbax) both training and loading use. The folder records its format version
(`FORMAT_VERSION`, in run.json); folders written before it read as format 0, and a newer
format is refused with the upgrade to make.
"""

from eqllm.runs.checkpoints import Checkpointer
from eqllm.runs.checksums import fingerprints, verify_fingerprints
from eqllm.runs.errors import (
    CheckpointMismatch,
    MissingRunFile,
    NewerRunFormat,
    RunFolderError,
    UnverifiedCheckpoint,
)
from eqllm.runs.files import atomic_write_text
from eqllm.runs.folder import FORMAT_VERSION, Adapters, RunFolder, run_folder_of
from eqllm.runs.heldout import HeldOut, HeldOutSource

__all__ = [
    "FORMAT_VERSION",
    "Adapters",
    "CheckpointMismatch",
    "Checkpointer",
    "HeldOut",
    "HeldOutSource",
    "MissingRunFile",
    "NewerRunFormat",
    "RunFolder",
    "RunFolderError",
    "UnverifiedCheckpoint",
    "atomic_write_text",
    "fingerprints",
    "run_folder_of",
    "verify_fingerprints",
]
