"""Streaming safetensors reading and writing, one tensor at a time.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header mapping each name to its dtype, shape and byte range, then the raw bytes. Tensors
are read with `readinto` straight into the caller's buffer and written from views of the
caller's arrays, so neither direction holds more than one extra tensor: memory-mapping the file
instead would keep every page it touched resident and double the peak while loading.
The files are checked against the `safetensors` library itself in the tests.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eqllm.errors import EqllmError

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(jnp.bfloat16),  # ml_dtypes' bfloat16, as JAX uses
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_ALIGN = 64  # JAX on CPU adopts a host buffer without copying only when it is 64-byte aligned.

if sys.byteorder != "little":  # pragma: no cover - every platform JAX runs on is little-endian
    raise ImportError("eqllm.hub reads safetensors (little-endian) only on little-endian hosts")


class CheckpointError(EqllmError):
    """A checkpoint that cannot be read as asked; the message names the file and tensor."""


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one .safetensors file (without reading them) and its metadata."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise CheckpointError(f"{path}: not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    data_start = 8 + length
    size = path.stat().st_size
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {entry['dtype']}, which eqllm does not read "
                f"(supported: {', '.join(_DTYPES)})"
            )
        begin, end = entry["data_offsets"]
        info = TensorInfo(
            path, _DTYPES[entry["dtype"]], tuple(entry["shape"]), data_start + begin, end - begin
        )
        if info.nbytes != int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has a byte range that fits no shape")
        if info.start + info.nbytes > size:
            raise CheckpointError(f"{path}: truncated file (tensor {name!r} runs past its end)")
        tensors[name] = info
    return tensors, metadata


class TensorReader:
    """Reads tensors from one or several .safetensors files, each by name, into new buffers."""

    def __init__(self, files: Iterable[Path]):
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            tensors, _ = read_header(file)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.tensors[name].file.name} and {file.name}"
                    )
                self.tensors[name] = info
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name`; written into `out` (C-contiguous, same shape and dtype) when given."""
        info = self.tensors[name]
        if out is None:
            out = aligned_empty(info.shape, info.dtype)
        assert out.shape == info.shape and out.dtype == info.dtype and out.flags.c_contiguous
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = info.file.open("rb", buffering=0)
        handle.seek(info.start)
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < info.nbytes:  # readinto may return less than asked on large reads
            n = handle.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{info.file}: unexpected end of file in tensor {name!r}")
            done += n
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its name, shape and dtype now, its values from `make()` later."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_file(path: Path, tensors: Sequence[PlannedTensor], metadata: dict[str, str]) -> None:
    """Write one .safetensors file, making and writing the tensors one after another."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data then starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for t in tensors:
            array = np.ascontiguousarray(t.make())
            if array.shape != t.shape or array.dtype != t.dtype:
                raise AssertionError(f"{t.name}: planned {t.shape} {t.dtype}, got {array.shape}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)


def shard(tensors: Sequence[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Consecutive groups of at most `max_shard_size` bytes (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like '5GB', '500MB', '2GiB'."""
    if isinstance(size, int):
        return size
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    if text.endswith("B"):
        text = text[:-1]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a size like '5GB'") from None
