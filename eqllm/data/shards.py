"""Sharded, parallel and resumable encoding of a document stream into token files.

`prepare` tokenizes in shards inside a work folder ``<cache_dir>/.<name>.partial/``::

    plan.json                 shard_bytes, n_docs, total_bytes, the first document of each shard
    tokenizer.json ...        the tokenizer (a trained BPE is kept, so a resume does not retrain)
    shard-000007.train.bin    token ids of shard 7's training documents, each + eot
    shard-000007.val.bin      the same for its validation documents
    shard-000007.json         its counts, written last: a shard is finished when this exists

A shard is the run of consecutive documents that starts where the previous one passed
``shard_bytes`` UTF-8 bytes, so the shards depend on the documents and ``shard_bytes`` alone, not
on the number of workers. The main process reads the documents once, in order, and hands each
shard to a worker process (``workers > 1``, at most ``workers + 1`` shards handed out) or encodes it
itself (``workers = 1``); memory is bounded by a few shards' text whatever the corpus size. When
every shard is finished they are concatenated, in order, into ``train.bin`` / ``val.bin``.

A process killed half-way leaves its finished shards; the next `prepare` with the same inputs reads
the plan, skips the documents of finished shards without encoding them, and encodes the rest. The
result is byte-identical to an uninterrupted run, with one worker or many.

Worker processes (not the tokenizers library's threads alone) because the work around the
encoder is Python: reading and decompressing, JSON parsing, converting ids to arrays and writing
them; ``encode_batch`` still spreads each chunk over its threads inside every worker. Workers are
spawned (not forked: the parent may hold JAX's or the tokenizers library's threads).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np
import tokenizers

from eqllm.progress import progress_bar

from .errors import DataError
from .sources import DataSource
from .tokenizer import Tokenizer

SPLITS = ("train", "val")
COUNT_KEYS = tuple(f"{s}_{c}" for s in SPLITS for c in ("tokens", "bytes", "docs"))
_WORKER_TOKENIZER: Tokenizer | None = None


class SourceChanged(DataError):
    """The source yielded other documents than when its plan was made: the plan is stale."""


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def make_plan(source: DataSource, shard_bytes: int) -> dict:
    """Pass 1 over the documents: their count, total UTF-8 bytes and the shard boundaries."""
    if not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise DataError(
            f"shard_bytes={shard_bytes!r} must be a positive int (UTF-8 bytes of text per shard; "
            "the default is 16 MiB)."
        )
    starts, n_docs, total, in_shard = [0], 0, 0, 0
    for doc in source.documents():
        if in_shard >= shard_bytes:
            starts.append(n_docs)
            in_shard = 0
        n = len(doc.encode("utf-8"))
        n_docs, total, in_shard = n_docs + 1, total + n, in_shard + n
    return {"shard_bytes": shard_bytes, "n_docs": n_docs, "total_bytes": total, "starts": starts}


def finished_shards(work: Path, n_shards: int) -> set[int]:
    return {i for i in range(n_shards) if (work / f"{shard_name(i)}.json").is_file()}


def encode_shards(
    source: DataSource,
    tok: Tokenizer,
    is_val: np.ndarray,
    plan: dict,
    work: Path,
    dtype: np.dtype,
    *,
    workers: int,
    chunk_bytes: int,
    progress: bool,
) -> None:
    """Pass 2: encode every unfinished shard of `plan` into `work` (see the module docstring)."""
    n_docs = plan["n_docs"]
    bounds = [*plan["starts"], n_docs]
    n_shards = len(plan["starts"])
    done = finished_shards(work, n_shards)
    bar = progress_bar(  # off a terminal: a line every tenth of the bytes, no redrawn bar
        total=plan["total_bytes"],
        unit="B",
        every=max(plan["total_bytes"] // 10, 1),
        desc=f"tokenizing ({tok.kind}, vocab {tok.vocab_size}, {workers} worker(s))",
        file=sys.stderr,
        disable=not progress,
    )
    tokens = 0

    def finished(counts: dict) -> None:
        nonlocal tokens
        tokens += counts["train_tokens"] + counts["val_tokens"]
        bar.set_postfix({"tokens": f"{tokens:,}"})  # the bar counts bytes; tokens beside them
        bar.update(counts["train_bytes"] + counts["val_bytes"])

    for i in sorted(done):  # a resume: these shards count as done at once
        finished(json.loads((work / f"{shard_name(i)}.json").read_text()))
    pool = None
    if workers > 1 and len(done) < n_shards:
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(tok.kind, tok.to_str(), tok.eot_token),
        )
    in_flight: deque[Future] = deque()

    def run(shard: int, docs: list[str]) -> None:
        flags = is_val[bounds[shard] : bounds[shard + 1]]
        args = (shard, docs, flags, str(work), dtype.name, chunk_bytes)
        if pool is None:
            finished(encode_shard(*args, tok=tok))
            return
        in_flight.append(pool.submit(encode_shard, *args))
        while len(in_flight) > workers:  # back-pressure: at most workers + 1 shards of text
            finished(in_flight.popleft().result())

    try:
        shard, docs, index = 0, [], -1
        for index, doc in enumerate(source.documents()):
            if index >= n_docs:
                break
            if index == bounds[shard + 1]:
                if shard not in done:
                    run(shard, docs)
                shard, docs = shard + 1, []
            if shard not in done:
                docs.append(doc)
        if index + 1 != n_docs:
            raise SourceChanged(
                f"{source.describe()} changed while being read ({n_docs} documents, then "
                f"{index + 1}); a source must yield the same documents each time it is read."
            )
        if shard not in done:
            run(shard, docs)
        while in_flight:
            finished(in_flight.popleft().result())
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _init_worker(kind: str, tokenizer_json: str, eot_token: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json), eot_token, kind)


def encode_shard(
    shard: int,
    docs: list[str],
    flags: np.ndarray,
    work: str,
    dtype_name: str,
    chunk_bytes: int,
    *,
    tok: Tokenizer | None = None,
) -> dict:
    """Encode one shard's documents (`flags`: True for validation) into its two .bin files in
    chunks of about `chunk_bytes` characters; write its counts file last and return the counts."""
    tok = tok if tok is not None else _WORKER_TOKENIZER
    assert tok is not None, "encode_shard runs in a worker set up by _init_worker, or with tok="
    folder, name, dtype = Path(work), shard_name(shard), np.dtype(dtype_name)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    eot = np.array([tok.eot_id], dtype=np.int64)
    paths = {s: folder / f"{name}.{s}.bin" for s in SPLITS}
    files = {s: open(f"{paths[s]}.tmp", "wb") for s in SPLITS}
    try:
        start = 0
        while start < len(docs):
            stop, size = start, 0
            while stop < len(docs) and (stop == start or size < chunk_bytes):
                size += len(docs[stop])
                stop += 1
            chunk, chunk_flags = docs[start:stop], flags[start:stop]
            encoded = tok.encode_batch(chunk)
            for split, want in (("train", False), ("val", True)):
                parts = [
                    p
                    for ids, v in zip(encoded, chunk_flags, strict=True)
                    if v == want
                    for p in (ids, eot)
                ]
                if parts:
                    arr = np.concatenate(parts).astype(dtype)
                    arr.tofile(files[split])
                    counts[f"{split}_tokens"] += arr.shape[0]
            for doc, v in zip(chunk, chunk_flags, strict=True):
                split = "val" if v else "train"
                counts[f"{split}_bytes"] += len(doc.encode("utf-8"))
                counts[f"{split}_docs"] += 1
            start = stop
    finally:
        for f in files.values():
            f.close()
    for s in SPLITS:
        os.replace(f"{paths[s]}.tmp", paths[s])
    marker = folder / f"{name}.json"
    Path(f"{marker}.tmp").write_text(json.dumps(counts))
    os.replace(f"{marker}.tmp", marker)  # the shard is finished once its counts file exists
    return counts


def assemble(work: Path, n_shards: int) -> dict:
    """Concatenate the finished shards, in order, into train.bin / val.bin inside `work`; remove
    them as they are copied and return the summed counts."""
    counts = dict.fromkeys(COUNT_KEYS, 0)
    outputs = {s: open(work / f"{s}.bin", "wb") for s in SPLITS}
    try:
        for i in range(n_shards):
            name = shard_name(i)
            for key, value in json.loads((work / f"{name}.json").read_text()).items():
                counts[key] += value
            for s in SPLITS:
                with open(work / f"{name}.{s}.bin", "rb") as f:
                    shutil.copyfileobj(f, outputs[s], 256 << 10)
            # The marker goes first: a kill here leaves an unfinished shard, encoded again.
            (work / f"{name}.json").unlink()
            for s in SPLITS:
                (work / f"{name}.{s}.bin").unlink()
    finally:
        for f in outputs.values():
            f.close()
    return counts
