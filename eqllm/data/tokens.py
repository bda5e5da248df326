"""Tokenize a corpus once into memory-mapped token files.

`prepare(source, tokenizer)` writes a cache folder::

    <cache_dir>/<kind>-<key>/
        train.bin          token ids of the training documents, each followed by the eot token
        val.bin            the same for the validation documents
        tokenizer.json     the tokenizer (with tokenizer_config.json naming its eot token)
        meta.json          dtype, vocab_size, eot_id, token/byte/document counts, fingerprint

``<key>`` hashes the source fingerprint, the tokenizer spec and the split settings, so the same
inputs reuse the folder without tokenizing again. The folder is built in shards under
``.<kind>-<key>.partial`` and renamed into place (`os.replace`), so an interrupted run never leaves
a half-written cache, and the next run resumes from its finished shards (`eqllm.data.shards`).
Documents are streamed: memory does not grow with the corpus.

The train/validation split is by document: a seeded permutation of the document indices puts
``round(n_docs * val_fraction)`` documents (at least one when there are two or more and
``val_fraction > 0``) in validation. A BPE tokenizer is trained on the training documents only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from .errors import DataError, DataNotFound
from .shards import SourceChanged, assemble, encode_shards, make_plan
from .sources import DataSource
from .tokenizer import Tokenizer

Split = Literal["train", "val"]
CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    """``$EQLLM_CACHE/tokens`` if set, else ``~/.cache/eqllm/tokens``."""
    root = os.environ.get("EQLLM_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "eqllm"
    return base / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise DataError(f"vocab_size={vocab_size} does not fit uint32 token files.")


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of length `n_docs`: True for the documents of the validation split.

    A function of (n_docs, val_fraction, seed) only. ``round(n_docs * val_fraction)`` documents,
    but at least one when ``n_docs >= 2`` and ``val_fraction > 0``, and never all of them.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(
            f"val_fraction={val_fraction!r} must be in [0, 1): it is the fraction of documents "
            "held out for validation (0.01 is typical; 0 for no validation split)."
        )
    n_val = round(n_docs * val_fraction)
    if val_fraction > 0 and n_docs >= 2:
        n_val = min(max(n_val, 1), n_docs - 1)
    mask = np.zeros(n_docs, dtype=bool)
    perm = np.random.default_rng([seed, n_docs]).permutation(n_docs)
    mask[perm[:n_val]] = True
    return mask


@dataclasses.dataclass
class TokenData:
    """A prepared corpus: read-only token arrays of both splits, their tokenizer and metadata.

    ``train`` and ``val`` are `np.memmap` (an empty `np.ndarray` for an empty split); every
    document is followed by ``tokenizer.eot_id``.
    """

    path: Path
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    meta: dict

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenData:
        """Open a folder written by `prepare`."""
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise DataNotFound(
                f"{str(path)!r} is not a prepared token folder (no meta.json); create one with "
                "eqllm.data.prepare(source, tokenizer, cache_dir=...)."
            )
        meta = json.loads(meta_file.read_text())
        dtype = np.dtype(meta["dtype"])

        def open_split(split: str) -> np.ndarray:
            if meta[f"{split}_tokens"] == 0:
                return np.zeros(0, dtype)  # mmap cannot map an empty file
            arr = np.memmap(path / f"{split}.bin", dtype=dtype, mode="r")
            if arr.shape[0] != meta[f"{split}_tokens"]:
                raise DataError(
                    f"{path / f'{split}.bin'} holds {arr.shape[0]} tokens but meta.json says "
                    f"{meta[f'{split}_tokens']}; the cache is damaged, delete {str(path)!r} and "
                    "prepare again."
                )
            return arr

        tokenizer = Tokenizer.load(path)
        return cls(path, open_split("train"), open_split("val"), tokenizer, meta)

    def bytes_per_token(self, split: Split = "train") -> float:
        """UTF-8 bytes of the split's text per token (eot tokens counted as tokens).

        Bits per byte = (mean loss in nats per token) / ln 2 / bytes_per_token.
        """
        if split not in ("train", "val"):
            raise DataError(f"split={split!r} must be 'train' or 'val'.")
        tokens = self.meta[f"{split}_tokens"]
        if tokens == 0:
            raise DataError(f"The {split} split of {self.path} is empty; it has no bytes/token.")
        return self.meta[f"{split}_bytes"] / tokens


def _tokenizer_key(
    tokenizer: str | os.PathLike | Tokenizer, bpe_vocab_size: int, bpe_min_frequency: int
) -> tuple[str, dict, Tokenizer | None]:
    """(folder label, key dict, the tokenizer when it needs no training)."""
    if isinstance(tokenizer, str) and tokenizer == "bpe":
        return (
            f"bpe{bpe_vocab_size}",
            {"kind": "bpe", "vocab_size": bpe_vocab_size, "min_frequency": bpe_min_frequency},
            None,
        )
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.from_spec(tokenizer)
    digest = hashlib.sha256((tok.to_str() + "\0" + tok.eot_token).encode()).hexdigest()
    label = "bytes" if tok.kind == "bytes" else tok.kind
    return label, {"kind": tok.kind, "tokenizer_sha256": digest}, tok


def prepare(
    source: DataSource,
    tokenizer: str | os.PathLike | Tokenizer = "bytes",
    *,
    cache_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    bpe_vocab_size: int = 4096,
    bpe_min_frequency: int = 2,
    progress: bool = True,
    chunk_bytes: int = 4 << 20,
    workers: int = 1,
    shard_bytes: int = 16 << 20,
) -> TokenData:
    """Tokenize `source` into a cached train/val pair of token files and return them.

    Arguments:
        source: the corpus.
        tokenizer: ``"bytes"``, ``"bpe"`` (trained here on the training split with
            `bpe_vocab_size` ids), a tokenizer.json path or folder, a hub repo id, or a
            `Tokenizer`.
        cache_dir: where prepared folders live (default `default_cache_dir()`).
        val_fraction, seed: the by-document split (see `split_documents`).
        progress: show progress on stderr while tokenizing (a bar on a terminal, else a line
            every tenth of the bytes).
        chunk_bytes: text handed to `encode_batch` at once (memory vs. parallelism).
        workers: processes that encode shards (1: this process); the token files are the same
            for any number.
        shard_bytes: UTF-8 bytes of text per shard, the unit of parallel work and of a resume
            (`eqllm.data.shards`); memory grows with about ``(workers + 2) * shard_bytes``, not
            with the corpus. The token files do not depend on it.

    Returns:
        The `TokenData`; a second call with the same inputs returns the cached folder at once.
    """
    if not isinstance(source, DataSource):
        raise DataError(
            f"source must be an eqllm.data.DataSource, got {type(source).__name__}; e.g. "
            "DataSource.stdlib() or DataSource.files('corpus/')."
        )
    split_documents(0, val_fraction, seed)  # validates val_fraction early
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    label, tok_key, tok = _tokenizer_key(tokenizer, bpe_vocab_size, bpe_min_frequency)
    fingerprint = source.fingerprint()
    key = {
        "format": CACHE_FORMAT,
        "source": fingerprint,
        "tokenizer": tok_key,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_dir / f"{label}-{digest}"
    if (final / "meta.json").is_file():
        return TokenData.load(final)
    if not isinstance(workers, int) or workers < 1:
        raise DataError(
            f"workers={workers!r} must be a positive int: the processes that tokenize shards "
            "(1 tokenizes in this process)."
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{final.name}.lock"):  # one builder per folder at a time
        if (final / "meta.json").is_file():  # another process built it while we waited
            return TokenData.load(final)
        work = cache_dir / f".{final.name}.partial"
        bpe = (bpe_vocab_size, bpe_min_frequency)
        plan, tok = _resume_or_plan(
            source, work, tok, shard_bytes, val_fraction, seed, bpe, progress
        )
        is_val = split_documents(plan["n_docs"], val_fraction, seed)
        dtype = token_dtype(tok.vocab_size)
        try:
            encode_shards(
                source,
                tok,
                is_val,
                plan,
                work,
                dtype,
                workers=workers,
                chunk_bytes=chunk_bytes,
                progress=progress,
            )
        except SourceChanged:
            shutil.rmtree(work, ignore_errors=True)  # its shards follow a stale plan
            raise
        counts = assemble(work, len(plan["starts"]))
        meta = {
            "format": CACHE_FORMAT,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "eot_token": tok.eot_token,
            "tokenizer_kind": tok.kind,
            **counts,
            "fingerprint": fingerprint,
            "source": dataclasses.asdict(source),
            "key": key,
        }
        (work / PLAN).unlink()
        # meta.json is written last and the folder renamed into place: it appears whole.
        (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(work, final)
        # A process still waiting on this lock finds meta.json when it gets the lock.
        (cache_dir / f".{final.name}.lock").unlink(missing_ok=True)
    return TokenData.load(final)


PLAN = "plan.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _resume_or_plan(
    source: DataSource,
    work: Path,
    tok: Tokenizer | None,
    shard_bytes: int,
    val_fraction: float,
    seed: int,
    bpe: tuple[int, int],
    progress: bool,
) -> tuple[dict, Tokenizer]:
    """The plan and tokenizer of an interrupted run in `work` (same shard_bytes), else new ones:
    pass 1 over the documents, and a BPE trained on the training documents when `tok` is None."""
    plan_file = work / PLAN
    if plan_file.is_file():
        plan = json.loads(plan_file.read_text())
        if plan["shard_bytes"] == shard_bytes:
            return plan, (tok if tok is not None else Tokenizer.load(work))
    shutil.rmtree(work, ignore_errors=True)
    plan = make_plan(source, shard_bytes)
    if tok is None:  # BPE: trained on the training documents only
        is_val = split_documents(plan["n_docs"], val_fraction, seed)
        train_docs = (d for d, v in zip(source.documents(), is_val, strict=True) if not v)
        tok = Tokenizer.train_bpe(train_docs, bpe[0], min_frequency=bpe[1], progress=progress)
    work.mkdir()
    tok.save(work)
    # plan.json last: its presence marks a work folder that a later run may resume.
    (work / f"{PLAN}.tmp").write_text(json.dumps(plan))
    os.replace(work / f"{PLAN}.tmp", plan_file)
    return plan, tok
