"""Time and memory of one preference (DPO) train step on a zoo model: LoRA (reference = the
adapters off, in the same step), full fine-tuning with cached reference log-probabilities, and
full fine-tuning with the reference computed on the fly from a second, frozen copy.

    PYTHONPATH=. python benchmarks/preference_step.py llama-125m --pairs 2 --seq-len 128

Memory is XLA's analysis of the compiled step (arguments + temporaries; the arguments include
the model, the optimizer state and, on the fly, the reference copy); time is the median of a
few steps after compilation, on whatever device JAX uses.
"""

import argparse
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm import lora
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train.objectives import Preference, sequence_logps


class OnTheFly(Preference):
    """DPO with the reference computed in the step from a frozen copy (an array field: the
    step takes it as an argument it does not donate)."""

    reference: Any = None

    def scores(self, model, batch):
        tokens, mask = batch["tokens"], batch["mask"]
        pairs = tokens.shape[0]
        flat = tokens.reshape(2 * pairs, -1), mask.reshape(2 * pairs, -1)
        policy = sequence_logps(model, *flat).reshape(pairs, 2)
        ref = jax.lax.stop_gradient(sequence_logps(self.reference, *flat).reshape(pairs, 2))
        return policy, ref, mask.sum(-1).astype(jnp.float32), {}


def fresh(model):
    """A copy with its own buffers: the step donates the model it is given."""
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(jnp.copy, arrays), static)


def measure(name, model, objective, batch, steps):
    optimizer = make_optimizer(OptimSpec(lr=1e-5, warmup_steps=0), 100, model)
    opt_state = init_opt_state(optimizer, model)
    step = TrainStep(optimizer, schedule(OptimSpec(), 100), objective=objective)
    compiled = step.lower(model, opt_state, batch).compile()
    mem = compiled.compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model, opt_state, metrics = step(model, opt_state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    print(
        f"{name:28s} step {statistics.median(times[1:]):6.2f} s  memory {total / 2**20:8.0f} MiB "
        f"(arguments {mem.argument_size_in_bytes / 2**20:.0f}, temporaries "
        f"{mem.temp_size_in_bytes / 2**20:.0f})"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variant")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=["lora", "cached", "on-the-fly"], default=None)
    args = parser.parse_args()
    base = eqllm.zoo.create(args.variant, key=jax.random.key(0))
    vocab = base.config.vocab_size
    rng = np.random.default_rng(0)
    shape = (args.pairs, 2, args.seq_len + 1)
    tokens = jnp.asarray(rng.integers(0, vocab, shape))
    mask = jnp.asarray(np.arange(args.seq_len)[None, None] >= args.seq_len // 2).repeat(
        args.pairs, 0
    )
    mask = jnp.broadcast_to(mask, (args.pairs, 2, args.seq_len))
    batch = {"tokens": tokens, "mask": mask}
    print(f"{args.variant}: {args.pairs} pairs x {args.seq_len} tokens, {jax.devices()[0]}")
    adapted = lora.apply(
        base, rank=8, alpha=16, targets=["q_proj", "v_proj"], key=jax.random.key(1)
    )
    if args.only in (None, "lora"):
        lora_run = fresh(adapted)
        measure("LoRA (adapters off)", lora_run, Preference("dpo", 0.1), batch, args.steps)
    if args.only in (None, "cached"):
        cached = {**batch, "ref": jnp.zeros((args.pairs, 2))}
        measure("full, cached reference", fresh(base), Preference("dpo", 0.1), cached, args.steps)
    if args.only in (None, "on-the-fly"):
        objective = OnTheFly("dpo", 0.1, reference=fresh(base))
        measure("full, reference on the fly", fresh(base), objective, batch, args.steps)


if __name__ == "__main__":
    main()
