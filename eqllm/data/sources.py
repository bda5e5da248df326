"""Text sources: where training documents come from.

A `DataSource` is a frozen, serializable description of a corpus. `documents()` yields its
documents (non-empty `str`) in a fixed order, and `fingerprint()` is a stable hash of the
description plus the sizes and modification times of the local files it reads, used as a cache key.

Kinds:

- ``"stdlib"``: the built-in offline corpus, the running interpreter's standard library ``.py``
  files (``site-packages`` excluded), one document per file, in sorted path order.
- ``"files"``: a text file, a folder searched recursively (``*.txt``, ``*.md``, ``*.py``,
  ``*.txt.gz``, ``*.txt.zst`` or ``glob``), or a glob pattern; one document per file.
- ``"jsonl"``: JSON-lines file(s) (a file, a folder of ``*.jsonl`` / ``*.jsonl.gz`` /
  ``*.jsonl.zst``, or a glob); one document per line, read from ``text_field``, streamed line by
  line.
- ``"hf"``: a Hugging Face dataset through ``datasets.load_dataset(name, config, split=...,
  streaming=..., data_files=path)`` (a hub id, or a builder such as ``"parquet"``, ``"arrow"`` or
  ``"json"`` with local ``data_files``), or a folder written by ``Dataset.save_to_disk``.

Files ending in ``.gz`` or ``.zst`` are decompressed while read (`eqllm.data.readers`).

Files that are not valid UTF-8 are skipped; empty documents are skipped. ``max_bytes`` caps the
total UTF-8 size of what `documents()` yields (the document that crosses the cap is cut at it), so
a small deterministic subset of any source is one field away.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from .errors import DataError, DataNotFound
from .readers import (
    _cap,
    _expand,
    _has_local_files,
    _is_pattern,
    _read_files,
    _read_jsonl,
    _stdlib_files,
)

SourceKind = Literal["stdlib", "files", "jsonl", "hf"]
_KINDS = ("stdlib", "files", "jsonl", "hf")
DEFAULT_FILE_PATTERNS = ("*.txt", "*.md", "*.py", "*.txt.gz", "*.txt.zst")
DEFAULT_JSONL_PATTERNS = ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst")


@typing.no_type_check  # validates itself in __post_init__, with messages that say more
@dataclasses.dataclass(frozen=True)
class DataSource:
    """A corpus description. Build with the class methods or the fields directly.

    Fields:
        kind: ``"stdlib" | "files" | "jsonl" | "hf"``.
        path: file, folder or glob (``files``, ``jsonl``); ``data_files`` for ``hf``.
        text_field: the field holding the text (``jsonl``, ``hf``).
        name, config, split, streaming: arguments of ``datasets.load_dataset`` (``hf``).
        glob: file pattern used inside a folder (``files``, ``jsonl``).
        max_bytes: cap on the total UTF-8 bytes yielded, or ``None`` for all.
    """

    kind: SourceKind = "stdlib"
    path: str | None = None
    text_field: str = "text"
    name: str | None = None
    config: str | None = None
    split: str = "train"
    streaming: bool = False
    glob: str | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise DataError(
                f"DataSource.kind={self.kind!r} is not a known source kind; use one of {_KINDS}."
            )
        if self.kind in ("files", "jsonl") and not self.path:
            raise DataError(
                f"DataSource(kind={self.kind!r}) needs `path`: a file, a folder or a glob pattern."
            )
        if self.kind == "hf" and not self.name:
            raise DataError(
                "DataSource(kind='hf') needs `name`: a Hugging Face dataset id (e.g. "
                "'roneneldan/TinyStories'), a builder such as 'json' with `path` as data_files, "
                "or a folder written by Dataset.save_to_disk."
            )
        if self.max_bytes is not None and (
            not isinstance(self.max_bytes, int) or self.max_bytes <= 0
        ):
            raise DataError(
                f"DataSource.max_bytes={self.max_bytes!r} must be a positive int, or None for "
                "no cap."
            )

    # Constructors -----------------------------------------------------------------------------

    @classmethod
    def stdlib(cls, max_bytes: int | None = None) -> DataSource:
        """The Python standard library's source code (offline, present on every machine)."""
        return cls(kind="stdlib", max_bytes=max_bytes)

    @classmethod
    def files(
        cls, path: str | os.PathLike, *, glob: str | None = None, max_bytes: int | None = None
    ) -> DataSource:
        """One document per file: a file, a folder (recursive) or a glob pattern."""
        return cls(kind="files", path=os.fspath(path), glob=glob, max_bytes=max_bytes)

    @classmethod
    def jsonl(
        cls,
        path: str | os.PathLike,
        *,
        text_field: str = "text",
        max_bytes: int | None = None,
    ) -> DataSource:
        """One document per JSON line, taken from ``text_field``."""
        return cls(kind="jsonl", path=os.fspath(path), text_field=text_field, max_bytes=max_bytes)

    @classmethod
    def hf(
        cls,
        name: str,
        config: str | None = None,
        *,
        split: str = "train",
        streaming: bool = False,
        text_field: str = "text",
        data_files: str | None = None,
        max_bytes: int | None = None,
    ) -> DataSource:
        """A Hugging Face dataset (hub id, builder name with ``data_files``, or saved folder)."""
        return cls(
            kind="hf",
            name=name,
            config=config,
            split=split,
            streaming=streaming,
            text_field=text_field,
            path=data_files,
            max_bytes=max_bytes,
        )

    # Reading ----------------------------------------------------------------------------------

    def documents(self) -> Iterator[str]:
        """Return an iterator over the non-empty documents, in a fixed order, at most ``max_bytes``.

        Files that are not UTF-8 text (or cannot be read) are skipped, and said so in one
        warning once the iterator is exhausted. Raises `DataNotFound` for a missing path and
        `DataError` when the source holds no readable text at all.
        """
        # Paths are resolved here, eagerly, so a missing path fails at the call, not later.
        skipped: list[str] = []
        if self.kind == "stdlib":
            docs = _read_files(_stdlib_files(), skipped)
        elif self.kind == "files":
            docs = _read_files(self._files(), skipped)
        elif self.kind == "jsonl":
            docs = _read_jsonl(self._files(), self.text_field)
        else:
            docs = self._hf_documents()
        return self._checked(_cap(docs, self.max_bytes), skipped)

    def _checked(self, docs: Iterator[str], skipped: list[str]) -> Iterator[str]:
        count = 0
        for doc in docs:
            count += 1
            yield doc
        unread = ""
        if skipped:
            shown = ", ".join(skipped[:3]) + (
                f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            )
            unread = (
                f"skipped {len(skipped)} file(s) that are not UTF-8 text or unreadable: {shown}"
            )
        if count == 0:
            raise DataError(
                f"{self.describe()} yielded no documents: the files are empty, not UTF-8 text, or "
                "have no text in the expected field. Point the source at text data (or check "
                f"`text_field`/`glob`).{' It ' + unread + '.' if unread else ''}"
            )
        if unread:
            warnings.warn(f"{self.describe()}: {unread}", stacklevel=2)

    def fingerprint(self) -> str:
        """A stable hex digest of the spec and of the local files' sizes and mtimes."""
        h = hashlib.sha256()
        h.update(json.dumps(dataclasses.asdict(self), sort_keys=True).encode())
        if self.kind == "stdlib":
            h.update(sys.version.encode())
            files = _stdlib_files()
        elif self.kind in ("files", "jsonl"):
            files = self._files()
        elif self.path is not None and _has_local_files(self.path):
            files = _expand(self.path, None, ("*",))
        elif Path(self.name).is_dir():
            files = sorted(p for p in Path(self.name).rglob("*") if p.is_file())
        else:
            # A hub dataset: the spec is all we know without network access.
            files = []
        for f in files:
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def describe(self) -> str:
        """A one-line human description, for messages and logs."""
        if self.kind == "stdlib":
            return f"DataSource(stdlib at {sysconfig.get_paths()['stdlib']})"
        if self.kind == "hf":
            return f"DataSource(hf {self.name!r}, config={self.config!r}, split={self.split!r})"
        return f"DataSource({self.kind} {self.path!r})"

    # Internals --------------------------------------------------------------------------------

    def _files(self) -> list[Path]:
        assert self.path is not None
        if self.kind == "jsonl":
            patterns = (self.glob,) if self.glob else DEFAULT_JSONL_PATTERNS
            expected = "a .jsonl file, a folder of .jsonl files, or a glob pattern"
        else:
            patterns = (self.glob,) if self.glob else DEFAULT_FILE_PATTERNS
            expected = "a text file, a folder of text files, or a glob pattern"
        files = _expand(self.path, self.glob, patterns)
        if not files:
            if _is_pattern(self.path):
                raise DataNotFound(
                    f"The glob pattern {self.path!r} matched no files; expected {expected}."
                )
            if Path(self.path).is_dir():
                raise DataError(
                    f"The folder {self.path!r} holds no files matching {list(patterns)}; put "
                    f"text files there or pass `glob=` to select them."
                )
            raise DataNotFound(f"Data path {self.path!r} does not exist; expected {expected}.")
        return files

    def _hf_documents(self) -> Iterator[str]:
        if self.path is not None and not _has_local_files(self.path):
            raise DataNotFound(
                f"data_files {self.path!r} for the {self.name!r} dataset does not exist; "
                "expected a local file, folder or glob pattern."
            )
        return self._hf_rows()

    def _hf_rows(self) -> Iterator[str]:
        import datasets

        assert self.name is not None
        local = Path(self.name)
        if local.is_dir() and (
            (local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()
        ):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if self.split not in ds:
                    raise DataError(
                        f"The saved dataset {self.name!r} has splits {sorted(ds)}, not "
                        f"{self.split!r}; set `split` to one of them."
                    )
                ds = ds[self.split]
        else:
            ds = datasets.load_dataset(
                self.name,
                self.config,
                split=self.split,
                streaming=self.streaming,
                data_files=self.path,
            )
        columns = ds.column_names
        if columns is not None and self.text_field not in columns:
            raise DataError(
                f"{self.describe()} has no column {self.text_field!r} (columns: {columns}); set "
                "`text_field` to the column holding the text."
            )
        for index, row in enumerate(ds):
            if self.text_field not in row:  # a streamed dataset may not know its columns ahead
                raise DataError(
                    f"{self.describe()} row {index} has no field {self.text_field!r} (found: "
                    f"{sorted(row)}); set `text_field` to the column holding the text."
                )
            text = row[self.text_field]
            if isinstance(text, str) and text:
                yield text
