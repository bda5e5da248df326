"""LoRA against full fine-tuning: trainable parameters, optimizer state, peak memory, step time.

    python benchmarks/finetune_memory.py [llama-125m] [--batch 4 --seq 256 --steps 3 --rank 8]

Both use the real `TrainStep` and `make_optimizer` (AdamW) on the same model and batch. LoRA
adapts every projection (q, k, v, o, gate, up, down) at `--rank`, alpha = 2 * rank. Peak memory
is XLA's own account of the compiled step (arguments + outputs - aliased + temporaries), the
number that decides whether a step fits a device; step time is the median of `--steps` steps
after compilation, fp32 on whatever device JAX finds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import numpy as np

from eqllm import lora, zoo
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


def measure(model, tokens: np.ndarray, steps: int) -> dict:
    spec = OptimSpec(warmup_steps=0)
    optimizer = make_optimizer(spec, 100, model)
    opt_state = init_opt_state(optimizer, model)
    step = TrainStep(optimizer, schedule(spec, 100))
    trainable = eqx.filter(model, lora.trainable(model))
    compiled = step.lower(model, opt_state, jax.numpy.asarray(tokens)).compile()
    mem = compiled.compiled.memory_analysis()
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    result = {
        "trainable": sum(x.size for x in jax.tree.leaves(trainable)),
        "params": sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))),
        "opt_state_bytes": nbytes(opt_state),
        "peak_bytes": peak,
        "temp_bytes": mem.temp_size_in_bytes,
    }
    times = []
    for _ in range(steps + 1):  # the first call may still pay for dispatch set-up
        t0 = time.perf_counter()
        model, opt_state, metrics = step(model, opt_state, tokens)
        jax.block_until_ready((model, metrics["loss"]))
        times.append(time.perf_counter() - t0)
    result["step_s"] = statistics.median(times[1:])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", nargs="?", default="llama-125m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    vocab = zoo.config(args.variant).vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (args.batch, args.seq + 1))
    # A model of its own for each: the step donates (deletes) the buffers it is given.
    rows = {"full": measure(zoo.create(args.variant, key=jax.random.key(0)), tokens, args.steps)}
    adapted = lora.apply(
        zoo.create(args.variant, key=jax.random.key(0)),
        rank=args.rank,
        alpha=2 * args.rank,
        targets=TARGETS,
        key=jax.random.key(1),
    )
    rows[f"lora r={args.rank}"] = measure(adapted, tokens, args.steps)
    print(f"{args.variant}, batch {args.batch} x {args.seq}, fp32, {jax.devices()[0].device_kind}")
    print(
        "| method | trainable params | optimizer state | peak memory (XLA) | step time |\n"
        "|---|---|---|---|---|"
    )
    for name, r in rows.items():
        print(
            f"| {name} | {r['trainable']:,} ({100 * r['trainable'] / r['params']:.2f}%) | "
            f"{r['opt_state_bytes'] / 2**20:,.1f} MiB | {r['peak_bytes'] / 2**20:,.0f} MiB | "
            f"{r['step_s']:.2f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
