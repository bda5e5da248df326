"""Contracts of eqllm.data on tiny corpora: no network, a few seconds in all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from eqllm.data import (
    DataError,
    DataSource,
    TokenData,
    Tokenizer,
    batch_at,
    eval_batches,
    prepare,
    split_documents,
    token_dtype,
)

TEXTS = [
    "Hello, world!",
    "Grüße aus Köln — naïve café, déjà vu.",
    "日本語のテキストと絵文字 🎉🐍",
    "def f(x):\n    return x ** 2  # <|endoftext|> inside a document is text\n",
    "Ελληνικά και русский текст.",
]

STDLIB_SMALL = DataSource.stdlib(max_bytes=200_000)


def _bpe_corpus() -> list[str]:
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(50)]
    return TEXTS * 20 + lines


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(_bpe_corpus(), 400)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        (root / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    (root / "broken.txt").write_bytes(b"\xff\xfe\x00binary")
    return root


# Tokenizers ---------------------------------------------------------------------------------------


def test_bytes_tokenizer_round_trip():
    tok = Tokenizer.bytes()
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        # The fast path agrees with the Hugging Face model it stands in for.
        assert ids == tok.hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert tok.encode_batch([text])[0].tolist() == ids
    assert tok.decode([0xFF, ord("a"), tok.eot_id]) == "\ufffda<|endoftext|>"


def test_bpe_round_trip_and_determinism(bpe):
    assert bpe.vocab_size == 400 and bpe.decode([bpe.eot_id]) == "<|endoftext|>"
    unseen = "Zürich 北京 🚀 <|endoftext|> unseen words"
    for text in [*TEXTS, unseen]:
        assert bpe.decode(bpe.encode(text)) == text
    assert bpe.eot_id not in bpe.encode(TEXTS[3])
    assert len(bpe.encode("the quick brown fox")) < len("the quick brown fox")
    again = Tokenizer.train_bpe(_bpe_corpus(), 400)
    assert again.to_str() == bpe.to_str()


def test_tokenizer_save_load(tmp_path, bpe):
    bpe.save(tmp_path / "tok")
    for path in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        loaded = Tokenizer.from_spec(str(path))
        assert (loaded.kind, loaded.vocab_size, loaded.eot_id) == ("bpe", 400, bpe.eot_id)
        assert loaded.encode(TEXTS[1]) == bpe.encode(TEXTS[1])


def test_pretrained_eot_from_config_or_vocab(tmp_path):
    hf = tokenizers.Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "<bos>": 2}, unk_token="a"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.load(tmp_path).eot_id == 1  # falls back to </s>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<bos>"}}))
    assert Tokenizer.load(tmp_path).eot_id == 2
    bare = tmp_path / "bare"
    bare.mkdir()
    no_eot = tokenizers.Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    no_eot.save(str(bare / "tokenizer.json"))
    with pytest.raises(ValueError, match="end-of-text token"):
        Tokenizer.load(bare)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_spec(str(tmp_path / "missing.json"))


# Sources ------------------------------------------------------------------------------------------


def test_folder_source_skips_binary(folder):
    with pytest.warns(UserWarning, match=r"skipped 1 file.*broken.txt \(not UTF-8\)"):
        docs = list(DataSource.files(folder).documents())
    assert sorted(docs) == sorted(TEXTS)
    assert list(DataSource.files(folder).documents()) == docs  # fixed order
    assert list(DataSource.files(folder / "doc0.txt").documents()) == [TEXTS[0]]
    assert len(list(DataSource.files(str(folder / "sub" / "*.txt")).documents())) == 2


def test_jsonl_source(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"body": t, "id": i} for i, t in enumerate(TEXTS)]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    assert list(DataSource.jsonl(path, text_field="body").documents()) == TEXTS
    with pytest.raises(ValueError, match="no field 'text'"):
        list(DataSource.jsonl(path).documents())


def test_hf_sources_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    path = tmp_path / "data.json"
    path.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    for streaming in (False, True):
        src = DataSource.hf("json", data_files=str(path), streaming=streaming)
        assert list(src.documents()) == TEXTS
    with pytest.raises(ValueError, match="no column 'body'"):
        list(DataSource.hf("json", data_files=str(path), text_field="body").documents())
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))}).save_to_disk(saved)
    src = DataSource.hf(str(saved))
    assert list(src.documents()) == TEXTS
    assert src.fingerprint() == DataSource.hf(str(saved)).fingerprint()


def test_stdlib_source_capped():
    docs = list(STDLIB_SMALL.documents())
    assert sum(len(d.encode("utf-8")) for d in docs) <= 200_000
    assert len(docs) > 2 and any("def " in d for d in docs)
    assert STDLIB_SMALL.fingerprint() == DataSource.stdlib(max_bytes=200_000).fingerprint()
    assert STDLIB_SMALL.fingerprint() != DataSource.stdlib(max_bytes=100_000).fingerprint()


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DataSource.files(tmp_path / "nowhere").documents()
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        DataSource.jsonl(tmp_path / "nowhere.jsonl").documents()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(DataError, match=r"no documents.*skipped 1 file.*blob.txt \(not UTF-8\)"):
        list(DataSource.files(tmp_path).documents())
    with pytest.raises(ValueError, match="kind"):
        DataSource(kind="web")  # type: ignore[arg-type]


def test_unreadable_files_are_counted_and_named(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "zeros.txt").write_bytes(b"ab\x00cd")
    with pytest.warns(
        UserWarning, match=r"skipped 2 file\(s\).*latin1.txt \(not UTF-8\).*zeros.txt \(binary\)"
    ):
        assert list(DataSource.files(tmp_path).documents()) == ["some text"]


# Token files --------------------------------------------------------------------------------------


def test_token_dtype():
    assert token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_prepare_bytes_and_cache_reuse(tmp_path, monkeypatch):
    data = prepare(STDLIB_SMALL, "bytes", cache_dir=tmp_path, progress=False)
    meta = data.meta
    assert data.train.dtype == np.uint16 and isinstance(data.train, np.memmap)
    assert meta["train_tokens"] == meta["train_bytes"] + meta["train_docs"]  # + one eot per doc
    assert meta["val_docs"] >= 1 and meta["train_bytes"] + meta["val_bytes"] == 200_000
    assert data.train[-1] == data.val[-1] == data.tokenizer.eot_id
    assert data.bytes_per_token("val") == pytest.approx(meta["val_bytes"] / meta["val_tokens"])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left

    def fail(*args, **kwargs):
        raise AssertionError("prepare tokenized again instead of reusing the cache")

    monkeypatch.setattr(Tokenizer, "encode_batch", fail)
    monkeypatch.setattr(Tokenizer, "train_bpe", fail)
    again = prepare(STDLIB_SMALL, "bytes", cache_dir=tmp_path, progress=False)
    assert again.path == data.path and np.array_equal(again.train, data.train)
    assert TokenData.load(data.path).meta == meta


def test_interrupted_prepare_leaves_no_cache_folder(tmp_path, monkeypatch):
    real = Tokenizer.encode_batch
    calls = []

    def dies_on_second_chunk(self, texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        prepare(STDLIB_SMALL, "bytes", cache_dir=tmp_path, chunk_bytes=50_000, progress=False)
    # No cache folder, only the hidden work folder a later call resumes (tests/test_streaming.py).
    assert all(p.name.startswith(".") for p in tmp_path.iterdir())
    monkeypatch.setattr(Tokenizer, "encode_batch", real)
    data = prepare(STDLIB_SMALL, "bytes", cache_dir=tmp_path, chunk_bytes=50_000, progress=False)
    assert data.meta["train_bytes"] + data.meta["val_bytes"] == 200_000


def test_prepare_split_is_by_document(tmp_path):
    docs = [f"document number {i} " + "x" * (i % 7) for i in range(40)]
    src_path = tmp_path / "docs.jsonl"
    src_path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    data = prepare(
        DataSource.jsonl(src_path),
        "bytes",
        cache_dir=tmp_path / "cache",
        val_fraction=0.1,
        progress=False,
    )
    tok = data.tokenizer

    def split_docs(arr):
        text = tok.decode(arr)
        assert text.endswith("<|endoftext|>")
        return text.split("<|endoftext|>")[:-1]

    train, val = split_docs(data.train), split_docs(data.val)
    assert len(val) == 4 and len(train) == 36
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(docs)
    mask = split_documents(40, 0.1, 0)
    assert [d for d, v in zip(docs, mask, strict=True) if v] == val
    assert split_documents(2, 0.01, 0).sum() == 1 and split_documents(1, 0.5, 0).sum() == 0


def test_prepare_bpe_trains_on_train_split_only(tmp_path):
    src = DataSource.stdlib(max_bytes=60_000)
    data = prepare(src, "bpe", cache_dir=tmp_path, bpe_vocab_size=300, progress=False)
    assert data.tokenizer.kind == "bpe" and data.meta["vocab_size"] == 300
    assert data.meta["train_tokens"] < data.meta["train_bytes"]  # BPE compresses
    text = data.tokenizer.decode(data.val)
    val_docs = text.split("<|endoftext|>")[:-1]
    docs = list(src.documents())
    mask = split_documents(len(docs), 0.01, 0)
    assert val_docs == [d for d, v in zip(docs, mask, strict=True) if v]
    # Another vocab size or seed is another cache folder.
    other = prepare(src, "bpe", cache_dir=tmp_path, bpe_vocab_size=280, progress=False)
    assert other.path != data.path


def test_prepare_uint32_for_large_vocab(tmp_path, folder):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"<extra_{i}>": len(vocab) + i for i in range(70_000)})
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "big.json"))
    data = prepare(
        DataSource.files(folder), str(tmp_path / "big.json"), cache_dir=tmp_path, progress=False
    )
    assert data.tokenizer.vocab_size > 65536 and data.train.dtype == np.uint32
    assert data.train[-1] == data.tokenizer.eot_id == 70_256


def test_prepare_errors(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(STDLIB_SMALL, "bytes", cache_dir=tmp_path, val_fraction=1.0)
    with pytest.raises(FileNotFoundError):
        prepare(DataSource.files(tmp_path / "absent"), "bytes", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="Tokenizer"):
        prepare(STDLIB_SMALL, "./no/such/tokenizer.json", cache_dir=tmp_path)


# Batches ------------------------------------------------------------------------------------------


def test_batch_at_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    kw = dict(batch_size=8, seq_len=32)
    a = batch_at(tokens, step=5, seed=1, **kw)
    assert a.shape == (8, 33) and a.dtype == np.int32
    assert np.array_equal(a, batch_at(tokens, step=5, seed=1, **kw))
    assert not np.array_equal(a, batch_at(tokens, step=6, seed=1, **kw))
    assert not np.array_equal(a, batch_at(tokens, step=5, seed=2, **kw))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows
    # The global batch is the same for any process count; processes take row blocks.
    shards = [
        batch_at(tokens, step=5, seed=1, process_index=i, process_count=4, **kw) for i in range(4)
    ]
    assert np.array_equal(np.concatenate(shards), a)
    # Offsets reach both ends of the array over many steps.
    starts = np.concatenate(
        [batch_at(tokens, step=s, seed=0, batch_size=64, seq_len=998)[:, 0] for s in range(20)]
    )
    assert set(starts.tolist()) == {0, 1}


def test_batch_errors():
    tokens = np.arange(10, dtype=np.uint16)
    with pytest.raises(ValueError, match="seq_len"):
        batch_at(tokens, step=0, seed=0, batch_size=2, seq_len=10)
    with pytest.raises(ValueError, match="divide"):
        batch_at(tokens, step=0, seed=0, batch_size=3, seq_len=4, process_count=2)
    with pytest.raises(ValueError, match="seq_len"):
        next(eval_batches(tokens, batch_size=2, seq_len=10))


def test_eval_batches_cover_every_target_once():
    tokens = np.arange(1, 104, dtype=np.uint16)  # 103 tokens, 102 targets
    batches = list(eval_batches(tokens, batch_size=4, seq_len=10))
    assert len(batches) == 3  # 11 windows -> 3 batches of 4, last one padded
    targets = np.concatenate([b[:, 1:][m] for b, m in batches])
    assert np.array_equal(targets, tokens[1:])
    assert all(b.shape == (4, 11) and m.shape == (4, 10) for b, m in batches)
    assert len(list(eval_batches(tokens, batch_size=4, seq_len=10, max_batches=2))) == 2
    halves = [
        list(eval_batches(tokens, batch_size=4, seq_len=10, process_index=i, process_count=2))
        for i in range(2)
    ]
    for k, (b, _) in enumerate(batches):
        assert np.array_equal(np.concatenate([halves[0][k][0], halves[1][k][0]]), b)
