"""How fast the eqllm step could get: the step with its attention core ablated, next to PyTorch.

    python benchmarks/step_budget.py llama-mini [--batch 16 --seq 256 --steps 8]

Three training steps on the same batch, run alternately step by step so that machine noise hits
all alike: the eqllm step as `eqllm bench` times it; the same step with the attention core
(`in_order_attention`: scores, mask, softmax, weighted values) replaced by an element-wise
stand-in that still uses q, k and v (so no projection is dropped as dead code); and the
transformers eager step. It prints the medians, the share of the eqllm step the attention core
takes, and the step time that `eqllm bench`'s target of 1.3x transformers eager would need.

The ablated step is a lower bound on what any attention implementation could reach inside this
step (a free attention); if it is slower than the target's step time, the target is out of reach
by attention work alone, whatever kernel is written.
"""

from __future__ import annotations

import argparse

import numpy as np

import eqllm
import eqllm.nn.attention as attention_module
from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens
from eqllm.bench.torch_bench import TorchBench


def free_attention(q, k, v, sliding_window=None):
    """An element-wise stand-in for the attention core with its output shape and inputs."""
    groups = q.shape[-2] // k.shape[-2]
    return q * (k + v).repeat(groups, axis=-2)


def ablated_bench(cfg, tokens) -> JaxBench:
    """A `JaxBench` whose step was traced with `free_attention` in place of the real core."""
    real = attention_module.in_order_attention
    attention_module.in_order_attention = free_attention
    try:
        bench = JaxBench(cfg, tokens)
        bench.compile()
    finally:
        attention_module.in_order_attention = real
    return bench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    cfg = bench_config(zoo.config(args.variant), args.seq)
    tokens = random_tokens(cfg.vocab_size, args.batch, args.seq)
    full = JaxBench(cfg, tokens)
    full.compile()
    benches = {
        "eqllm step": full,
        "eqllm step, attention core ablated": ablated_bench(cfg, tokens),
        "transformers eager step": TorchBench(cfg, tokens),
    }
    for bench in benches.values():
        bench.step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in benches}
    for _ in range(args.steps):
        for name, bench in benches.items():
            times[name].append(bench.step())
    median = {name: float(np.median(ts)) for name, ts in times.items()}
    tokens_per_step = args.batch * args.seq
    for name, seconds in median.items():
        print(f"{name:36s} {1e3 * seconds:7.0f} ms  {tokens_per_step / seconds:7.0f} tokens/s")
    core = median["eqllm step"] - median["eqllm step, attention core ablated"]
    print(
        f"attention core: {1e3 * core:.0f} ms, {100 * core / median['eqllm step']:.0f}% of the step"
    )
    eager, free = median["transformers eager step"], median["eqllm step, attention core ablated"]
    print(f"1.3x transformers eager needs a step of {1e3 * eager / 1.3:.0f} ms")
    print(f"with a free attention core, eqllm is at {eager / free:.2f}x transformers eager")
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    raise SystemExit(main())
