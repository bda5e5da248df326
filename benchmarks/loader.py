"""Data loader speed: `prepare` tokenization throughput and `batch_at` tokens/s.

    PYTHONPATH=. python benchmarks/loader.py [--max-bytes 20000000] [--bpe-vocab 4096]

Tokenizes the stdlib corpus (capped at --max-bytes) into a fresh temporary cache with the bytes
tokenizer and with a BPE, then times `batch_at` (16 x 256) on the BPE training tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from eqllm.data import DataSource, Tokenizer, batch_at, prepare, split_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=20_000_000)
    parser.add_argument("--bpe-vocab", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()

    source = DataSource.stdlib(max_bytes=args.max_bytes)
    docs = list(source.documents())
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"corpus: stdlib, {len(docs)} documents, {n_bytes / 1e6:.1f} MB")

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        data = prepare(source, "bytes", cache_dir=cache, progress=False)
        dt = time.perf_counter() - t0
        tokens = data.meta["train_tokens"] + data.meta["val_tokens"]
        print(
            f"prepare bytes:      {dt:6.2f} s  {n_bytes / dt / 1e6:6.2f} MB/s  "
            f"{tokens / dt / 1e6:6.2f} M tokens/s  ({data.bytes_per_token('train'):.2f} B/token)"
        )

        # The BPE training step alone, on the same training split prepare uses.
        mask = split_documents(len(docs), 0.01, 0)
        t0 = time.perf_counter()
        Tokenizer.train_bpe((d for d, v in zip(docs, mask, strict=True) if not v), args.bpe_vocab)
        train_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        data = prepare(
            source, "bpe", cache_dir=cache, bpe_vocab_size=args.bpe_vocab, progress=False
        )
        dt = time.perf_counter() - t0
        tokens = data.meta["train_tokens"] + data.meta["val_tokens"]
        print(
            f"prepare bpe{args.bpe_vocab}:   {dt:6.2f} s  {n_bytes / dt / 1e6:6.2f} MB/s  "
            f"{tokens / dt / 1e6:6.2f} M tokens/s  ({data.bytes_per_token('train'):.2f} B/token; "
            f"BPE training alone {train_s:.2f} s, encoding ~{n_bytes / (dt - train_s) / 1e6:.2f} "
            "MB/s)"
        )

        t0 = time.perf_counter()
        again = prepare(source, "bpe", cache_dir=cache, bpe_vocab_size=args.bpe_vocab)
        print(f"prepare cached:     {time.perf_counter() - t0:6.3f} s  ({again.path.name})")

        train = data.train
        kw = dict(seed=0, batch_size=args.batch_size, seq_len=args.seq_len)
        batch_at(train, step=0, **kw)  # warm the page cache
        t0 = time.perf_counter()
        checksum = 0
        for step in range(args.steps):
            checksum += int(batch_at(train, step=step, **kw)[0, 0])
        dt = time.perf_counter() - t0
        per_batch = args.batch_size * args.seq_len
        print(
            f"batch_at {args.batch_size}x{args.seq_len}:    {dt / args.steps * 1e6:6.1f} us/batch  "
            f"{per_batch * args.steps / dt / 1e6:6.1f} M tokens/s  (checksum {checksum})"
        )
        del data, again, train  # close the memmaps before the folder is removed


if __name__ == "__main__":
    main()
