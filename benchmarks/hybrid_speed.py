"""A hybrid against an all-attention model of the same width and depth, on CPU: training-step
tokens/s and decode tokens/s at long contexts.

    PYTHONPATH=$PWD python benchmarks/hybrid_speed.py [--model qwen3_5-nano]
        [--contexts 2048 8192] [--steps 3] [--new 129]

The all-attention twin is the same config with `linear = None`: every layer the hybrid's
(gated) attention layer, with the same heads and sizes. fp32, random weights.

- Training: one (1, context) batch of random ids through eqllm's training step
  (`eqllm.bench.JaxBench`: `TrainStep` with AdamW); the median of `--steps` steps after one
  warm-up step, compile excluded.
- Decode: `eqllm.generation.stream`, greedy, `new` tokens from a prompt of `context - new`
  random ids, 16 tokens per compiled call; decode tokens/s counts the tokens after the first
  piece over the time from the first piece to the last (the prefill left out), the best of two
  runs after one that compiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens
from eqllm.generation import stream


def train_tokens_per_s(config, context: int, steps: int) -> float:
    bench = JaxBench(config, random_tokens(config.vocab_size, 1, context))
    bench.compile()
    bench.step()
    return context / statistics.median(bench.step() for _ in range(steps))


def decode_tokens_per_s(config, context: int, new: int, chunk: int = 16) -> float:
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, context - new)

    def once() -> float:
        times, counts = [], []
        for piece in stream(
            model, prompt, max_new_tokens=new, key=jax.random.key(0), temperature=0, chunk=chunk
        ):
            times.append(time.perf_counter())
            counts.append(len(piece))
        return (sum(counts) - counts[0]) / (times[-1] - times[0])

    once()  # compile
    return max(once() for _ in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_5-nano")
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new", type=int, default=129)
    args = parser.parse_args()
    hybrid = bench_config(zoo.config(args.model), max(args.contexts))
    kinds = hybrid.layer_kinds()
    print(
        f"{args.model}: d_model {hybrid.d_model}, {len(kinds)} layers ({kinds.count('full')} "
        f"attention); the twin: every layer attention. jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}, fp32"
    )
    print("| context | model | train tokens/s | decode tokens/s |")
    print("|---|---|---|---|")
    for context in args.contexts:
        for name, config in (("hybrid", hybrid), ("all attention", hybrid.replace(linear=None))):
            train = train_tokens_per_s(config, context, args.steps)
            decode = decode_tokens_per_s(config, context, args.new)
            print(f"| {context:,} | {name} | {train:,.0f} | {decode:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
