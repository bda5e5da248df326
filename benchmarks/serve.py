"""Serving throughput and time to first token at several numbers of concurrent clients.

Starts `eqllm serve`'s app in this process on 127.0.0.1 (a free port), then for each
concurrency C sends `--requests` streamed completions from C client threads (the official
`openai` client), greedy, with `ignore_eos` so each produces `--new` tokens. The client threads
run in a second process, as real clients would: in the server's process their interpreter lock
would take turns with the engine's. Reports output tokens/s over the wall time and time to
first token (p50, p99). Bounded: every loop is finite.

With `--vs-transformers`, the same prompts go through transformers' batched `generate` on the
same weights (a zoo name is first written as a Hugging Face folder, random weights, fp32), as a
static-batching server would run them: C requests at a time, greedy, `new` tokens each. Its time
to first token is the time from a batch's start to the first token of its requests (when
`generate` first calls the logits processors), which is what C clients in a closed loop would
see from a server that streams.

With `--shared-prefix N` every prompt starts with the same N tokens (a system prompt) before its
own `--prompt` tokens, and each row also reports the prefix cache's hit rate over its requests
(the share of their prompt tokens found in the cache); `--no-prefix-cache` computes every prompt
in full, for the comparison. The cache persists from row to row: a first row starts cold, and
each later row sends new prompts with the same prefix, which it then finds cached.

    PYTHONPATH=$PWD python benchmarks/serve.py MODEL [--concurrency 1 4 16 64]
        [--requests 64] [--prompt 32] [--new 32] [--max-batch 32] [--max-len 256]
        [--shared-prefix N] [--no-prefix-cache] [--vs-transformers]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai
import uvicorn

from eqllm import loading
from eqllm.hub import save_pretrained
from eqllm.serve import Engine
from eqllm.serve.app import Service, create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(client, prompt: list[int], new: int) -> tuple[float, int, float]:
    """(time to first token, tokens, total seconds) of one streamed request."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(
        model="bench",
        prompt=prompt,
        max_tokens=new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first or 0.0, tokens, time.perf_counter() - start


def _clients(port: int, prompts: list[list[int]], new: int, c: int) -> list[tuple]:
    """`prompts` sent from `c` threads of this (client) process; each one's `_one`."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        return list(pool.map(lambda p: _one(client, p, new), prompts))


def transformers_reference(folder: Path, prompts, new: int, concurrency) -> None:
    """transformers' batched generate on the same prompts: one table row per concurrency."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    class FirstCall(transformers.LogitsProcessor):
        """Notes when the first token's logits exist (the prefill is done)."""

        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            self.at = self.at or time.perf_counter()
            return scores

    def generate(batch) -> tuple[int, float]:
        first, start = FirstCall(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor(batch),
                attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[first],
            )
        return (out.shape[1] - len(batch[0])) * len(batch), first.at - start

    generate(prompts[:1])  # warm-up
    print("transformers generate (static batches of C):")
    _header()
    for c in concurrency:
        start, tokens, ttft = time.perf_counter(), 0, []
        for i in range(0, len(prompts), c):
            n, first = generate(prompts[i : i + c])
            tokens += n
            ttft += [first] * len(prompts[i : i + c])
        _row(c, len(prompts), tokens / (time.perf_counter() - start), np.array(ttft))


def _header(hits: bool = False) -> None:
    print(
        f"{'clients':>7} {'requests':>8} {'tokens/s':>9} {'TTFT p50 s':>10} {'TTFT p99 s':>10}"
        + (f" {'prefix hits':>11}" if hits else "")
    )


def _row(c: int, n: int, speed: float, ttft: np.ndarray, hits: float | None = None) -> None:
    p50, p99 = np.percentile(ttft, 50), np.percentile(ttft, 99)
    line = f"{c:>7} {n:>8} {speed:>9.1f} {p50:>10.3f} {p99:>10.3f}"
    print(line + ("" if hits is None else f" {hits:>11.1%}"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--vs-transformers", action="store_true")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.model)
    if args.vs_transformers and not folder.is_dir():  # the same weights for both
        folder = Path(tmp.name) / "model"
        save_pretrained(loading.load(args.model)[0], folder)
    model, tokenizer = loading.load(str(folder) if folder.is_dir() else args.model)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_len=args.max_len,
        max_queue=1024,
        prefix_cache=not args.no_prefix_cache,
    )
    start = time.perf_counter()
    engine.warm()
    seconds = time.perf_counter() - start
    print(f"{args.model}: compiled {len(engine.shapes())} shapes in {seconds:.1f} s")
    print(engine.describe())
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(Service(engine, tokenizer, model_name="bench")),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.1)
    # One client process for every row (spawned: no copy of this process's threads or JAX).
    clients = concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
    clients.submit(int, 0).result(timeout=600)  # started and imported before the first row
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    shared = rng.integers(1, vocab, args.shared_prefix).tolist()

    def fresh() -> list[list[int]]:  # the shared prefix, then tokens no earlier prompt had
        return [shared + rng.integers(1, vocab, args.prompt).tolist() for _ in range(args.requests)]

    prompts = fresh()
    own = f"{args.shared_prefix} shared + {args.prompt}" if shared else f"{args.prompt}"
    print(f"eqllm serve ({own}-token prompts, {args.new} new tokens, greedy):")
    _header(hits=bool(shared))
    for row, c in enumerate(args.concurrency):
        if shared and row:  # the shared prefix cached, the rest of each prompt new
            prompts = fresh()
        before = engine.stats()
        start = time.perf_counter()
        results = clients.submit(_clients, port, prompts, args.new, c).result(timeout=3600)
        wall = time.perf_counter() - start
        tokens = sum(r[1] for r in results)
        after = engine.stats()
        found = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        hits = found / (after["prompt_tokens"] - before["prompt_tokens"]) if shared else None
        _row(c, len(results), tokens / wall, np.array([r[0] for r in results]), hits)
    clients.shutdown()
    server.should_exit = True
    serving.join(timeout=60)  # the app's shutdown stops the engine before the interpreter exits
    if args.vs_transformers:
        transformers_reference(folder, prompts, args.new, args.concurrency)
    sys.exit(0)


if __name__ == "__main__":
    main()
