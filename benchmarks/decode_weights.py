"""Batch-1 decode speed with fp32, bf16 and int8 weights, on CPU, random weights, greedy.

Decode of one sequence reads every weight once per token, so on a memory-bound machine fewer
bytes per weight should mean more tokens per second. Compilation excluded (see
benchmarks/generate.py for the method: prefill + first token timed apart from the whole).

    PYTHONPATH=$PWD python benchmarks/decode_weights.py [--model llama-125m] [--new 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.hub.model_folder import with_param_dtype

sys.path.insert(0, str(Path(__file__).parent))
from generate import time_eqllm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-125m")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--weights", nargs="+", default=["fp32", "bf16", "int8"])
    args = parser.parse_args()
    base = zoo.create(args.model, key=jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, base.config.vocab_size, (1, args.prompt))
    print(f"{args.model}, batch 1, prompt {args.prompt}, new {args.new}, greedy")
    print(f"{'weights':<8} {'MB':>7} {'decode tok/s':>12}")
    for kind in args.weights:
        model = {
            "fp32": lambda: base,
            "bf16": lambda: with_param_dtype(base, "bfloat16"),
            "int8": lambda: eqllm.quantize(base, "int8"),
        }[kind]()
        mb = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))) / 1e6
        prefill_s, total_s = time_eqllm(model, prompts, args.new, args.repeats)
        print(f"{kind:<8} {mb:>7.0f} {(args.new - 1) / (total_s - prefill_s):>12.1f}", flush=True)


if __name__ == "__main__":
    main()
