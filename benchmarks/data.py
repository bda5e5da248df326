"""Data pipeline figures: tokenization MB/s and peak memory against `datasets.map`, and loader
tokens/s for plain windows, document-masked windows and a weighted mixture.

    PYTHONPATH=. python benchmarks/data.py [--mb 64] [--steps 2000] [--workers 1,2]
        [--shard-mb 16] [--tokenize-only]
    PYTHONPATH=. python benchmarks/data.py --padding runs/quickstart
    PYTHONPATH=. python benchmarks/data.py --mask-overhead llama-nano [--steps 20]

`--padding TOKENIZER` only prints the padding fraction of finetune-quickstart's rows (the
shipped python-instruct.jsonl, seq_len 96) padded, first-fit and best-fit packed.
`--mask-overhead VARIANT` times eqllm's train step (16 x 256, fp32) without and with document
masking (documents of 64 tokens), alternating one step of each so that a shared machine's
changing load falls on both alike, and prints the median of the per-pair ratios.

Generates a corpus of --mb megabytes of text files (random words, 2-20 kB documents), trains a
BPE of 4096 ids on its first 2 MB and saves it, then, each in a fresh child process (so its peak
resident memory is its own):

- `eqllm.data.prepare` with that tokenizer, once for each of `--workers` (1: one process, the
  tokenizers library's `encode_batch` spreading each 4 MB chunk over its own threads; N: N
  spawned worker processes encoding shards of `--shard-mb` MB);
- the reference: `datasets.Dataset.from_generator(...).map(batched=True, num_proc=2)` with the
  same tokenizer (the same encode_batch per batch, two worker processes).

Then it times the host side of a training batch (`batch_at`, 16 x 256): plain windows, the same
windows with their segment ids (`document_segments`, what data.document_mask adds; the step
computes them on the device, this is the host-side equivalent), and a 0.7/0.3 mixture of two
halves of the corpus (`MixtureData.batch_at`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
kind, corpus, tok_path, cache, shard_mb = sys.argv[1:6]
files = sorted(Path(corpus).glob("*.txt"))
n_bytes = sum(f.stat().st_size for f in files)
t0 = time.perf_counter()
if kind.startswith("eqllm"):
    from eqllm.data import DataSource, Tokenizer, prepare
    data = prepare(DataSource.files(corpus), Tokenizer.from_spec(tok_path), cache_dir=cache,
                   val_fraction=0.0, progress=False, workers=int(kind[5:]),
                   shard_bytes=int(float(shard_mb) * 2**20))
    tokens = data.meta["train_tokens"]
else:
    import datasets, tokenizers
    datasets.disable_progress_bars()
    tok = tokenizers.Tokenizer.from_file(tok_path + "/tokenizer.json")
    def gen():
        for f in files:
            yield {"text": f.read_text()}
    ds = datasets.Dataset.from_generator(gen, cache_dir=cache)
    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}
    out = ds.map(encode, batched=True, num_proc=2, remove_columns=["text"])
    tokens = sum(len(x) for x in out["ids"])
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "bytes": n_bytes, "tokens": tokens, "rss": max(rss, kids)}))
"""


def make_corpus(folder: Path, megabytes: int) -> None:
    rng = np.random.default_rng(0)
    words = np.array(
        "the of and to in is that for it as with was on be by this are from at or an which "
        "def return import class self value data model train step loss token window".split()
    )
    folder.mkdir(parents=True)
    written, i = 0, 0
    while written < megabytes * 1_000_000:
        text = " ".join(rng.choice(words, int(rng.integers(400, 4000)))) + "\n"
        (folder / f"{i:06d}.txt").write_text(text)
        written += len(text)
        i += 1


def tokenization(corpus: Path, tok: Path, root: Path, workers: list[int], shard_mb: float) -> None:
    for kind in [*(f"eqllm{w}" for w in workers), "datasets"]:
        cache = root / f"cache-{kind}"
        cmd = [sys.executable, "-c", CHILD, kind, str(corpus), str(tok), str(cache), str(shard_mb)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        label = f"prepare(workers={kind[5:]})" if kind != "datasets" else "datasets.map(num_proc=2)"
        print(
            f"{label:28s} {r['bytes'] / r['seconds'] / 1e6:7.2f} MB/s  "
            f"{r['tokens'] / r['seconds'] / 1e6:6.2f} M tokens/s  peak RSS "
            f"{r['rss'] / 2**20:7.0f} MiB  ({r['bytes'] / 1e6:.0f} MB, {r['seconds']:.1f} s)"
        )


def loader(corpus: Path, tok: Path, root: Path, steps: int) -> None:
    from eqllm.data import (
        DataSource,
        Tokenizer,
        batch_at,
        document_segments,
        prepare,
        prepare_mixture,
    )

    tokenizer = Tokenizer.from_spec(str(tok))
    halves = [root / "half0", root / "half1"]
    files = sorted(corpus.glob("*.txt"))
    for h, part in zip(halves, (files[::2], files[1::2]), strict=True):
        h.mkdir()
        for f in part[:200]:
            (h / f.name).symlink_to(f)
    data = prepare(
        DataSource.files(str(halves[0])), tokenizer, cache_dir=root / "c", progress=False
    )
    mixture = prepare_mixture(
        [
            (str(h.name), DataSource.files(str(h)), w)
            for h, w in zip(halves, (0.7, 0.3), strict=True)
        ],
        tokenizer,
        seq_len=256,
        cache_dir=root / "c",
        progress=False,
    )
    args = dict(seed=0, batch_size=16, seq_len=256)

    def timed(label, fn):
        fn(0)
        t0 = time.perf_counter()
        for s in range(steps):
            fn(s)
        dt = time.perf_counter() - t0
        print(f"{label:40s} {steps * 16 * 256 / dt / 1e6:7.2f} M tokens/s")

    timed("batch_at (plain windows)", lambda s: batch_at(data.train, step=s, **args))
    timed(
        "batch_at + document_segments",
        lambda s: np.asarray(document_segments(batch_at(data.train, step=s, **args), 0)),
    )
    timed("MixtureData.batch_at (0.7 / 0.3)", lambda s: mixture.batch_at(step=s, **args))


def padding(tokenizer: str) -> None:
    from eqllm.data import Tokenizer
    from eqllm.data.instruct import prepare_instructions
    from eqllm.recipe import finetune_data_path

    tok = Tokenizer.from_spec(tokenizer)
    path = finetune_data_path("data/python-instruct.jsonl")
    for pack in ("none", "first-fit", "best-fit"):
        d = prepare_instructions(path, tok, seq_len=96, val_fraction=0.1, pack=pack)
        print(
            f"pack={pack:9s} {len(d.rows):3d} rows of 97 tokens, padding {d.padding_fraction:.1%}, "
            f"{int(d.mask.sum())} trained targets"
        )


def mask_overhead(variant: str, steps: int) -> None:
    from eqllm import zoo
    from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens

    cfg = bench_config(zoo.config(variant), 256)
    tokens = random_tokens(cfg.vocab_size, 16, 256)
    plain, masked = JaxBench(cfg, tokens), JaxBench(cfg, tokens, document_length=64)
    plain.compile(), masked.compile()
    plain.step(), masked.step()
    pairs = [(plain.step(), masked.step()) for _ in range(steps)]
    ratio = float(np.median([a / b for a, b in pairs]))
    p, m = (float(np.median(x)) for x in zip(*pairs, strict=True))
    print(
        f"{variant} 16 x 256: step {p * 1e3:.1f} ms plain, {m * 1e3:.1f} ms masked (median of "
        f"{steps}); masked throughput {ratio:.3f}x plain (median of per-pair ratios)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="generated corpus size (MB)")
    parser.add_argument("--steps", type=int, default=2000, help="loader batches timed")
    parser.add_argument("--padding", metavar="TOKENIZER", help="only the packing figures")
    parser.add_argument("--mask-overhead", metavar="VARIANT", help="only the masking overhead")
    parser.add_argument(
        "--workers", default="1", help="comma-separated worker counts of eqllm.data.prepare"
    )
    parser.add_argument("--shard-mb", type=float, default=16, help="shard size of prepare")
    parser.add_argument(
        "--tokenize-only", action="store_true", help="only the tokenization figures"
    )
    args = parser.parse_args()
    if args.padding:
        return padding(args.padding)
    if args.mask_overhead:
        return mask_overhead(args.mask_overhead, args.steps)
    from eqllm.data import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus"
        make_corpus(corpus, args.mb)
        sample = (f.read_text() for f in sorted(corpus.glob("*.txt"))[:300])
        tok = root / "tok"
        Tokenizer.train_bpe(sample, 4096, progress=False).save(tok)
        print(f"corpus: {args.mb} MB generated; BPE of 4096 ids")
        tokenization(corpus, tok, root, [int(w) for w in args.workers.split(",")], args.shard_mb)
        if not args.tokenize_only:
            loader(corpus, tok, root, args.steps)


if __name__ == "__main__":
    main()
