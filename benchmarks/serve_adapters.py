"""Decode throughput of `eqllm serve` holding 0, 1 or 4 LoRA adapters, requests mixed over them.

For each adapter count n, random LoRA adapters (rank `--rank`, on q/k/v/o and the MLP, random
non-zero B) are stacked over one copy of a zoo model's random weights
(`eqllm.generation.adapters`) and the app is started in this process on 127.0.0.1 (a free
port). `--requests` streamed greedy completions (`ignore_eos`, `--new` tokens each) are sent
from `--clients` threads of the official `openai` client, request i naming adapter i mod n (the
base when n = 0). The engine is warmed (every shape compiled) before the clock starts. Reports
output tokens/s over the wall time, and the time to first token p50. Bounded: every loop is
finite.

    PYTHONPATH=$PWD python benchmarks/serve_adapters.py [MODEL] [--adapters 0 1 4]
        [--clients 16] [--requests 32] [--prompt 16] [--new 32] [--rank 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import threading
import time

import equinox as eqx
import jax
import numpy as np
import openai
import uvicorn

from eqllm import lora, zoo
from eqllm.generation.adapters import stack_adapters
from eqllm.serve import Engine
from eqllm.serve.app import Service, create_app

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adapter(base, rank: int, seed: int):
    """`base` with random LoRA adapters (B non-zero, so the update is computed in earnest)."""
    key = jax.random.key(seed)
    model = lora.apply(base, rank=rank, alpha=2 * rank, targets=TARGETS, key=key)

    def fill(node):
        if not lora.is_lora(node):
            return node
        b = 0.01 * jax.random.normal(key, node.lora_b.weight.shape, node.lora_b.weight.dtype)
        return eqx.tree_at(lambda m: m.lora_b.weight, node, b)

    return jax.tree.map(fill, model, is_leaf=lora.is_lora)


def _one(client, name: str, prompt: list[int], new: int) -> tuple[float, int]:
    start, first, tokens = time.perf_counter(), None, 0
    stream = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=new,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - start
            tokens += 1
    return first or 0.0, tokens


def run(base, n: int, args) -> None:
    names = [f"lora{i}" for i in range(n)]
    model = stack_adapters(base, [_adapter(base, args.rank, i) for i in range(n)]) if n else base
    engine = Engine(model, max_batch=args.clients, max_len=args.prompt + args.new, max_queue=256)
    start = time.perf_counter()
    engine.warm()
    compiled = time.perf_counter() - start
    service = Service(engine, None, model_name="base", adapters=names)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):  # bounded: 60 s
        if server.started:
            break
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    rng = np.random.default_rng(0)
    vocab = base.config.vocab_size
    jobs = [
        (names[i % n] if n else "base", rng.integers(1, vocab, args.prompt).tolist())
        for i in range(args.requests)
    ]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda job: _one(client, *job, args.new), jobs))
    wall = time.perf_counter() - start
    server.should_exit = True
    thread.join(timeout=60)
    tokens = sum(t for _, t in results)
    ttft = np.median([f for f, _ in results])
    print(
        f"| {n} | {tokens} | {wall:.1f} | {tokens / wall:.1f} | {ttft:.2f} | {compiled:.0f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-mini")
    parser.add_argument("--adapters", nargs="+", type=int, default=[0, 1, 4])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    base = zoo.create(args.model, key=jax.random.key(0))
    print(f"{args.model}, {args.clients} clients, {args.requests} requests of {args.prompt} + ")
    print(f"{args.new} tokens, rank {args.rank} on {', '.join(TARGETS)}\n")
    print("| adapters | tokens | wall s | tokens/s | TTFT p50 s | warm-up s |")
    print("|---|---|---|---|---|---|")
    for n in args.adapters:
        run(base, n, args)


if __name__ == "__main__":
    main()
