"""Serving throughput and time to first token at several numbers of concurrent clients.

Starts `eqllm serve`'s app in this process on 127.0.0.1 (a free port), then for each
concurrency C sends `--requests` streamed completions from C client threads (the official
`openai` client), greedy, with `ignore_eos` so each produces `--new` tokens. Reports output
tokens/s over the wall time and time to first token (p50, p99). Bounded: every loop is finite.

    PYTHONPATH=$PWD python benchmarks/serve.py MODEL [--concurrency 1 4 16 64]
        [--requests 64] [--prompt 32] [--new 32] [--max-batch 32] [--max-len 256]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import sys
import threading
import time

import numpy as np
import openai
import uvicorn

from eqllm import loading
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    args = parser.parse_args()

    model, tokenizer = loading.load(args.model)
    engine = Engine(model, max_batch=args.max_batch, max_len=args.max_len, max_queue=1024)
    start = time.perf_counter()
    engine.warm()
    seconds = time.perf_counter() - start
    print(f"{args.model}: compiled {len(engine.shapes())} shapes in {seconds:.1f} s")
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(Service(engine, tokenizer, model_name="bench")),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, args.prompt).tolist() for _ in range(args.requests)]
    print(f"{'clients':>7} {'requests':>8} {'tokens/s':>9} {'TTFT p50 s':>10} {'TTFT p99 s':>10}")
    for c in args.concurrency:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as pool:
            results = list(pool.map(lambda p: _one(client, p, args.new), prompts))
        wall = time.perf_counter() - start
        ttft = np.array([r[0] for r in results])
        tokens = sum(r[1] for r in results)
        print(
            f"{c:>7} {len(results):>8} {tokens / wall:>9.1f} "
            f"{np.percentile(ttft, 50):>10.3f} {np.percentile(ttft, 99):>10.3f}",
            flush=True,
        )
    server.should_exit = True
    sys.exit(0)


if __name__ == "__main__":
    main()
