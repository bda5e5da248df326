"""Tokenizing corpora larger than memory (eqllm.data.shards, eqllm.data.readers): streamed,
compressed and Hugging Face streaming sources, bounded memory, worker processes and resume. The
reference is the in-memory path: every document encoded alone, followed by the eot token."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from eqllm.data import DataError, DataSource, Tokenizer, prepare, split_documents
from eqllm.data import shards as shards_module

WORDS = np.array(
    "the of and to in is that for it as with was on be by this are from at or an which "
    "def return import class self value data model train step loss token window "
    "Grüße café naïve 日本語 🎉".split()
)


def make_docs(n: int, seed: int = 0, words: int = 400) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(words // 4, words, size=n)
    return [" ".join(WORDS[rng.integers(0, len(WORDS), size=k)]) for k in lengths]


def write_jsonl(path: Path, docs: list[str], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}) + "\n")
    return path


def in_memory(docs: list[str], tok: Tokenizer, val_fraction: float, seed: int = 0):
    """The reference: each document encoded alone (`Tokenizer.encode`), then the eot token."""
    is_val = split_documents(len(docs), val_fraction, seed)
    out = {}
    for split, want in (("train", False), ("val", True)):
        ids = [i for d, v in zip(docs, is_val, strict=True) if v == want for i in tok.encode(d)]
        ids_eot = []
        for d, v in zip(docs, is_val, strict=True):
            if v == want:
                ids_eot += [*tok.encode(d), tok.eot_id]
        assert len(ids_eot) == len(ids) + int((is_val == want).sum())
        out[split] = np.array(ids_eot, np.int64)
    return out


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(make_docs(60, seed=1), 400, progress=False)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(120)


def test_streamed_shards_equal_in_memory(tmp_path, docs, bpe):
    """Plain, gzip and zstd JSONL, any shard size: the token files equal the in-memory path."""
    zstandard = pytest.importorskip("zstandard")
    plain = write_jsonl(tmp_path / "a.jsonl", docs)
    gz = write_jsonl(tmp_path / "b.jsonl.gz", docs, gzip.open)
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    expected = in_memory(docs, bpe, 0.1)
    for path, shard_bytes in ((plain, 64 << 20), (gz, 20_000), (zst, 3_000)):
        data = prepare(
            DataSource.jsonl(path),
            bpe,
            cache_dir=tmp_path / f"cache-{path.name}",
            val_fraction=0.1,
            shard_bytes=shard_bytes,
            chunk_bytes=5_000,
            progress=False,
        )
        np.testing.assert_array_equal(np.asarray(data.train, np.int64), expected["train"])
        np.testing.assert_array_equal(np.asarray(data.val, np.int64), expected["val"])
        assert data.meta["train_docs"] + data.meta["val_docs"] == len(docs)
        assert not list(data.path.glob("shard-*")) and not (data.path / "plan.json").exists()
    # A folder of compressed text files: one document per file, read whole.
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, d in enumerate(docs[:5]):
        opener = gzip.open if i % 2 else open
        with opener(folder / f"{i}.txt{'.gz' if i % 2 else ''}", "wt", encoding="utf-8") as f:
            f.write(d)
    assert list(DataSource.files(folder).documents()) == docs[:5]


def _corpus(path: Path, megabytes: float) -> Path:
    """JSONL of about `megabytes` MB: one block of 200 documents (~1 MB), repeated."""
    block = "".join(
        json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in make_docs(200, words=800)
    )
    size = len(block.encode("utf-8"))
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(max(round(megabytes * 1e6 / size), 1)):
            f.write(block)
    return path


def _peak_heap(path: Path, cache: Path) -> tuple[int, dict]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        data = prepare(
            DataSource.jsonl(path),
            "bytes",
            cache_dir=cache,
            val_fraction=0.01,
            shard_bytes=200_000,
            chunk_bytes=50_000,
            progress=False,
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, data.meta


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak Python heap (numpy arrays included) while tokenizing 1 MB and 10 MB of JSONL: under
    a 3 MB limit, under a third of the large corpus, and the same for both within 0.5 MB."""
    small, small_meta = _peak_heap(_corpus(tmp_path / "small.jsonl", 1), tmp_path / "c1")
    big_path = _corpus(tmp_path / "big.jsonl", 10)
    big, big_meta = _peak_heap(big_path, tmp_path / "c2")
    assert big_path.stat().st_size > 3 * 3_000_000
    assert big_meta["train_docs"] + big_meta["val_docs"] == 10 * (
        small_meta["train_docs"] + small_meta["val_docs"]
    )
    assert big < 3_000_000, f"peak heap {big / 1e6:.2f} MB"
    assert abs(big - small) < 500_000, f"peak heap {small / 1e6:.2f} MB -> {big / 1e6:.2f} MB"


def test_resume_after_interruption_equals_uninterrupted(tmp_path, docs, bpe, monkeypatch):
    """Killed after two shards: a restart keeps them (they are not encoded again) and the result
    is byte-identical to an uninterrupted run."""
    source = DataSource.jsonl(write_jsonl(tmp_path / "d.jsonl", docs))
    args = dict(val_fraction=0.1, shard_bytes=8_000, chunk_bytes=3_000, progress=False)
    whole = prepare(source, bpe, cache_dir=tmp_path / "whole", **args)

    real = shards_module.encode_shard
    encoded: list[int] = []

    def dies_on_third(shard, *a, **k):
        if len(encoded) == 2:
            raise KeyboardInterrupt  # as a kill between two shards
        encoded.append(shard)
        return real(shard, *a, **k)

    monkeypatch.setattr(shards_module, "encode_shard", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, bpe, cache_dir=tmp_path / "resumed", **args)
    assert encoded == [0, 1]
    (work,) = (tmp_path / "resumed").glob(".*.partial")
    assert sorted(p.name for p in work.glob("shard-*.json")) == [
        "shard-000000.json",
        "shard-000001.json",
    ]
    assert not [p for p in (tmp_path / "resumed").iterdir() if not p.name.startswith(".")]

    def counts(shard, *a, **k):
        encoded.append(shard)
        return real(shard, *a, **k)

    encoded.clear()
    monkeypatch.setattr(shards_module, "encode_shard", counts)
    data = prepare(source, bpe, cache_dir=tmp_path / "resumed", **args)
    # Shards 0 and 1 were kept; the rest were encoded, once each, in order.
    assert len(encoded) >= 2 and encoded == list(range(2, 2 + len(encoded)))
    for split in ("train", "val"):
        assert (data.path / f"{split}.bin").read_bytes() == (
            whole.path / f"{split}.bin"
        ).read_bytes()
    assert {k: v for k, v in data.meta.items() if k != "key"} == {
        k: v for k, v in whole.meta.items() if k != "key"
    }
    assert not work.exists()


def test_a_source_that_changes_between_passes_is_refused_and_its_work_dropped(
    tmp_path, docs, monkeypatch
):
    source = DataSource.jsonl(write_jsonl(tmp_path / "d.jsonl", docs))
    real, calls = DataSource.documents, []

    def shrinking(self):
        calls.append(1)
        return real(self) if len(calls) == 1 else iter(list(real(self))[:-3])

    monkeypatch.setattr(DataSource, "documents", shrinking)
    with pytest.raises(DataError, match=r"changed while being read \(120 documents, then 117\)"):
        prepare(source, "bytes", cache_dir=tmp_path / "c", shard_bytes=5_000, progress=False)
    assert not list((tmp_path / "c").glob("*.partial"))  # the next call plans again


@pytest.mark.slow  # the first streamed load_dataset of a process takes seconds
def test_hf_streaming_sources(tmp_path, monkeypatch, docs, bpe):
    """datasets.load_dataset(..., streaming=True) over local parquet and arrow files built here
    (no network; JSON in tests/test_data.py) gives the in-memory path's token files."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    docs = docs[:40]
    ds = datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))})
    ds.to_parquet(str(tmp_path / "d.parquet"))
    (arrow,) = ds.save_to_disk(str(tmp_path / "saved")) or (tmp_path / "saved").glob("*.arrow")
    expected = in_memory(docs, bpe, 0.1)
    for builder, files in (("parquet", "d.parquet"), ("arrow", str(arrow))):
        source = DataSource.hf(builder, data_files=str(tmp_path / files), streaming=True)
        data = prepare(
            source,
            bpe,
            cache_dir=tmp_path / "c",
            val_fraction=0.1,
            shard_bytes=20_000,
            progress=False,
        )
        np.testing.assert_array_equal(np.asarray(data.train, np.int64), expected["train"])
        np.testing.assert_array_equal(np.asarray(data.val, np.int64), expected["val"])
    with pytest.raises(DataError, match="no column 'body'"):
        list(
            DataSource.hf(
                "parquet", data_files=str(tmp_path / "d.parquet"), streaming=True, text_field="body"
            ).documents()
        )


def test_bad_input_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl.gz", ["fine", "also fine"], gzip.open)
    with gzip.open(path, "at") as f:
        f.write(json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"x\.jsonl\.gz:3 has no field 'text'"):
        list(DataSource.jsonl(path).documents())
    damaged = write_jsonl(tmp_path / "damaged.jsonl.gz", make_docs(50), gzip.open)
    damaged.write_bytes(damaged.read_bytes()[:-12])  # truncated: the gzip trailer is missing
    with pytest.raises(DataError, match=r"damaged\.jsonl\.gz:\d+ cannot be read"):
        list(DataSource.jsonl(damaged).documents())
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz:1 cannot be read"):
        list(DataSource.jsonl(not_gzip).documents())
    src = DataSource.jsonl(write_jsonl(tmp_path / "ok.jsonl", ["a", "b"]))
    with pytest.raises(DataError, match="workers=0 must be a positive int"):
        prepare(src, "bytes", cache_dir=tmp_path / "c", workers=0, progress=False)
    with pytest.raises(DataError, match="shard_bytes=0 must be a positive int"):
        prepare(src, "bytes", cache_dir=tmp_path / "c", shard_bytes=0, progress=False)


def test_worker_processes_give_the_same_files(tmp_path, docs, bpe, capsys):
    """Two spawned worker processes write the same token files as one process; the progress
    lines count bytes and tokens."""
    source = DataSource.jsonl(write_jsonl(tmp_path / "d.jsonl", docs))
    args = dict(val_fraction=0.1, shard_bytes=10_000, chunk_bytes=4_000)
    one = prepare(source, bpe, cache_dir=tmp_path / "one", progress=False, **args)
    two = prepare(source, bpe, cache_dir=tmp_path / "two", workers=2, progress=True, **args)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    total_bytes = two.meta["train_bytes"] + two.meta["val_bytes"]
    total_tokens = two.meta["train_tokens"] + two.meta["val_tokens"]
    assert f"2 worker(s)) {total_bytes}/{total_bytes} B (100%) tokens={total_tokens:,}" in last
    for split in ("train", "val"):
        assert (one.path / f"{split}.bin").read_bytes() == (two.path / f"{split}.bin").read_bytes()
    assert one.meta == two.meta


KILLED_CHILD = """
import sys
from eqllm.data import DataSource, Tokenizer, prepare
prepare(DataSource.jsonl(sys.argv[1]), Tokenizer.load(sys.argv[2]), cache_dir=sys.argv[3],
        val_fraction=0.1, shard_bytes=100_000, workers=2, progress=False)
"""


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path, bpe, monkeypatch):
    """A tokenization with two workers, killed (SIGKILL to its whole process group) once a shard
    is finished: the restart encodes only the unfinished shards and equals an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    corpus = _corpus(tmp_path / "big.jsonl", 4)
    bpe.save(tmp_path / "tok")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(corpus), str(tmp_path / "tok"), str(cache)],
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not list(cache.glob(".*.partial/shard-*.json")):
        assert child.poll() is None and time.monotonic() < deadline, "no shard finished"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    (work,) = cache.glob(".*.partial")
    kept = {int(p.name[6:12]) for p in work.glob("shard-*.json")}
    n_shards = len(json.loads((work / "plan.json").read_text())["starts"])
    assert 0 < len(kept) < n_shards

    real = shards_module.encode_shard
    encoded: list[int] = []

    def counts(shard, *a, **k):
        encoded.append(shard)
        return real(shard, *a, **k)

    monkeypatch.setattr(shards_module, "encode_shard", counts)
    tok = Tokenizer.load(tmp_path / "tok")
    args = dict(val_fraction=0.1, shard_bytes=100_000, progress=False)
    resumed = prepare(DataSource.jsonl(corpus), tok, cache_dir=cache, **args)
    assert sorted(encoded) == sorted(set(range(n_shards)) - kept)
    whole = prepare(DataSource.jsonl(corpus), tok, cache_dir=tmp_path / "whole", **args)
    for split in ("train", "val"):
        assert (resumed.path / f"{split}.bin").read_bytes() == (
            whole.path / f"{split}.bin"
        ).read_bytes()


RSS_CHILD = """
import resource, sys
from eqllm.data import DataSource, prepare
prepare(DataSource.jsonl(sys.argv[1]), "bytes", cache_dir=sys.argv[2], val_fraction=0.01,
        shard_bytes=1_000_000, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
"""


@pytest.mark.slow
def test_peak_resident_memory_does_not_grow_with_the_corpus(tmp_path):
    """The peak resident memory of a process tokenizing 2 MB and then 40 MB of JSONL (the byte
    tokenizer, so that the time goes to reading and writing): 38 MB more text adds less than
    8 MB, so neither the text nor its tokens are ever held whole."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def peak(megabytes: int) -> int:
        corpus = _corpus(tmp_path / f"{megabytes}.jsonl", megabytes)
        cache = tmp_path / f"cache-{megabytes}"
        run = [sys.executable, "-c", RSS_CHILD, str(corpus), str(cache)]
        out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1]) * 1024

    small, big = peak(2), peak(40)
    assert big - small < 8_000_000, f"peak RSS {small / 1e6:.1f} MB -> {big / 1e6:.1f} MB"
