"""Reading the local files of a `DataSource`: path expansion, compressed text, JSON lines.

Files ending in ``.gz`` (gzip) or ``.zst`` (Zstandard, through the ``zstandard`` package) are
decompressed as a stream while they are read; everything else is read as it is. A JSONL file is
read line by line, so its size does not bound memory; a ``files`` document is one whole file.
"""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .errors import DataError, DataNotFound

COMPRESSED_SUFFIXES = (".gz", ".zst")


def open_binary(path: Path) -> io.BufferedIOBase:
    """`path` opened for reading, decompressed on the fly when it ends in .gz or .zst."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        import zstandard

        # read_across_frames: files written by `zstd` or in several frames read as one stream.
        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(
                open(path, "rb"), read_across_frames=True, closefd=True
            )
        )
    return open(path, "rb")


def _read_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a damaged file raises while read (OSError covers a bad gzip header)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, UnicodeDecodeError)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def _is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[")


def _has_local_files(path: str) -> bool:
    return bool(globlib.glob(path, recursive=True)) if _is_pattern(path) else Path(path).exists()


def _expand(path: str, glob: str | None, patterns: tuple[str, ...]) -> list[Path]:
    """Resolve a file, a folder (recursive over `patterns`) or a glob pattern to sorted files."""
    if _is_pattern(path):
        return sorted(Path(p) for p in globlib.glob(path, recursive=True) if Path(p).is_file())
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = {f for pattern in patterns for f in p.rglob(pattern) if f.is_file()}
        return sorted(found)
    return []


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataNotFound(
            f"The Python standard library folder {str(root)!r} does not exist, so the built-in "
            "'stdlib' corpus is unavailable; use a 'files', 'jsonl' or 'hf' source instead."
        )
    files = []
    for folder, subdirs, names in os.walk(root):
        # Pruned while walking: site-packages can be many times larger than the stdlib.
        subdirs[:] = [d for d in subdirs if d != "site-packages"]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(f for f in files if f.is_file())


def _read_files(files: list[Path], skipped: list[str]) -> Iterator[str]:
    """The UTF-8 text of each file; the others are appended to `skipped`, with the reason."""
    errors = _read_errors()
    for f in files:
        try:
            with open_binary(f) as fh:
                text = fh.read().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(f"{f.name} (not UTF-8)")
            continue
        except errors as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            skipped.append(f"{f.name} ({reason})")
            continue
        if "\x00" in text:
            skipped.append(f"{f.name} (binary)")
        elif text:
            yield text


def _read_jsonl(files: list[Path], field: str) -> Iterator[str]:
    errors = _read_errors()
    for f in files:
        lineno = 0
        try:
            with io.TextIOWrapper(open_binary(f), encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    text = _jsonl_text(line, f, lineno, field)
                    if text:
                        yield text
        except errors as e:
            reason = str(e) or type(e).__name__
            raise DataError(
                f"{f}:{lineno + 1} cannot be read ({type(e).__name__}: {reason}); the file is "
                "damaged, truncated or not UTF-8 JSON lines: repair or remove it."
            ) from None


def _jsonl_text(line: str, f: Path, lineno: int, field: str) -> str | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{f}:{lineno} is not valid JSON ({e.msg}); each line of a JSONL file must be one "
            "JSON object."
        ) from None
    if not isinstance(row, dict) or field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(
            f"{f}:{lineno} has no field {field!r} (found: {keys}); set `text_field` to the field "
            "holding the text."
        )
    text = row[field]
    if not isinstance(text, str):
        raise DataError(f"{f}:{lineno} field {field!r} is a {type(text).__name__}, not a string.")
    return text


def _cap(docs: Iterator[str], max_bytes: int | None) -> Iterator[str]:
    if max_bytes is None:
        yield from docs
        return
    left = max_bytes
    for doc in docs:
        data = doc.encode("utf-8")
        if len(data) >= left:
            cut = data[:left].decode("utf-8", errors="ignore")
            if cut:
                yield cut
            return
        left -= len(data)
        yield doc
