"""Batch-1 decode with fp32 and int8 weights, profiled and timed in alternating pairs, on CPU.

For each kind of weights, random weights of a zoo model: fp32; `int8-before`, `Int8Linear` as
it was (the product an `einsum` on a widened weight, the token embedding and tied head in fp32);
`int8-fp32-embed`, today's product with the table left in fp32; `int8`, `eqllm.quantize` now:

- profile of one decode step (the model's cached forward on one token, vmapped over one row as
  the engine runs it, layers unrolled) from XLA's compiled program, which load does not move:
  bytes of parameters, `cost_analysis()` bytes accessed, `memory_analysis()` temporaries, and
  the fusions that write a widened fp32 copy of an int8 weight (count and bytes);
- the step and the head alone (`CausalLM.logits` on one row), milliseconds per call (wall and
  process CPU time), median over alternating rounds (every kind in turn, so load hits them
  alike);
- whole decode through the engine (`eqllm.generate_batch`, greedy, prompt 16): tokens per
  second over `--new` tokens (the best time of 1 new token subtracted from the best of `--new`,
  3 runs each), in alternating pairs, and
  the int8 / fp32 ratio of each pair.

    PYTHONPATH=$PWD python benchmarks/int8_decode.py [--model smollm-135m] [--pairs 4]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.nn import Int8Linear
from eqllm.nn.linear import rows_times, zero_after

# a kLoop fusion writing a 2-D fp32 array from an int8 weight (`convert_element_type`)
WIDENED = re.compile(r"= f32\[(\d+),(\d+)\]\{1,0\} fusion\(.*convert_element_type")


class EinsumInt8Linear(Int8Linear):
    """`Int8Linear` as it computed before: an einsum on the weight widened to fp32."""

    def __call__(self, x, **kwargs):
        weight = self.weight + zero_after(jax.lax.stop_gradient(x)).astype(jnp.int8)
        y = rows_times(x, weight.astype(x.dtype), **kwargs) * self.scale.astype(x.dtype)
        return y if self.bias is None else y + self.bias


def _before(layer):
    if not isinstance(layer, Int8Linear):
        return layer
    old = EinsumInt8Linear.__new__(EinsumInt8Linear)  # stacked layers: not through __init__
    for name in ("weight", "scale", "bias", "axes", "init"):
        object.__setattr__(old, name, getattr(layer, name))
    return old


def kinds(base) -> dict:
    q = eqllm.quantize(base, "int8")
    plain_table = eqx.tree_at(lambda m: m.embed, q, base.embed)
    return {
        "fp32": base,
        "int8-before": jax.tree.map(
            _before, plain_table, is_leaf=lambda x: isinstance(x, Int8Linear)
        ),
        "int8-fp32-embed": plain_table,
        "int8": q,
    }


def step_fn(model, layers, cache, token, position):
    """One decode step of one row: the next token's logits and the cache (vmapped, batch 1)."""

    def one(cache, token, position):
        return model.prefill(token[None], position[None], cache, layers=layers)

    return jax.vmap(one)(cache, token, position)


def profile(model, length: int):
    """The compiled step and head, their arguments, and what XLA says of the step."""
    layers = model.layers()
    cache = jax.tree.map(lambda x: x[None], model.init_cache(length))
    token, position = jnp.zeros(1, jnp.int32), jnp.full(1, length // 2, jnp.int32)
    # The weights go in as one flat list: flattening the modules at every call costs the host
    # more than the step itself (~1,000 leaves through Equinox's Python flatten).
    leaves, treedef = jax.tree.flatten((model, layers))
    step = jax.jit(lambda leaves, *rest: step_fn(*jax.tree.unflatten(treedef, leaves), *rest))
    args = (leaves, cache, token, position)
    compiled = step.lower(*args).compile()
    text = compiled.as_text()
    widened = [int(a) * int(b) * 4 for a, b in WIDENED.findall(text)]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    head_leaves, head_tree = jax.tree.flatten(model)
    head = jax.jit(
        jax.vmap(lambda m, h: jax.tree.unflatten(head_tree, m).logits(h), in_axes=(None, 0))
    )
    hidden = jax.random.normal(jax.random.key(2), (1, model.config.d_model))
    facts = {
        "param MB": sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))) / 1e6,
        "bytes accessed MB": cost.get("bytes accessed", float("nan")) / 1e6,
        "temps MiB": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "widened fusions": len(widened),
        "widened MB": sum(widened) / 1e6,
    }
    return (step, args), (head, (head_leaves, hidden)), facts


def ms(f, args, calls: int = 5) -> tuple[float, float]:
    """Milliseconds per call: wall time, and the process's CPU time (every thread)."""
    jax.block_until_ready(f(*args))
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall / calls * 1e3, cpu / calls * 1e3


def engine_rate(model, prompts, new: int) -> float:
    """Decode tokens per second through the engine (compiled already)."""

    def run(n):
        start = time.perf_counter()
        eqllm.generate_batch(model, prompts, max_new_tokens=n, key=jax.random.key(0), temperature=0)
        return time.perf_counter() - start

    # best of 3 of each: under load a single difference of two timings can even come out negative
    return (new - 1) / (min(run(new) for _ in range(3)) - min(run(1) for _ in range(3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm-135m")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="cache positions of the step")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's decode")
    parser.add_argument("--engine-only", action="store_true", help="skip the step's profile")
    args = parser.parse_args()
    models = kinds(zoo.create(args.model, key=jax.random.key(0)))
    if not args.engine_only:
        step_profile(models, args)
    if not args.no_engine:
        engine_pairs(models, args)


def step_profile(models: dict, args) -> None:
    pieces = {name: profile(m, args.length) for name, m in models.items()}
    print(f"{args.model}, batch 1, one decode step (XLA's compiled program):")
    for name, (_, _, facts) in pieces.items():
        print(f"  {name:<16} " + ", ".join(f"{k} {v:.1f}" for k, v in facts.items()))

    times = {name: {"step": [], "head": []} for name in models}
    for _ in range(args.pairs):
        for name, (step, head, _) in pieces.items():
            times[name]["step"].append(ms(*step))
            times[name]["head"].append(ms(*head))
    print(f"ms per call (wall / CPU), median of {args.pairs} alternating rounds:")
    for name, t in times.items():
        step = [statistics.median(x) for x in zip(*t["step"], strict=True)]
        head = [statistics.median(x) for x in zip(*t["head"], strict=True)]
        rounds = " ".join(f"{w:.1f}" for w, _ in t["step"])
        print(
            f"  {name:<16} step {step[0]:6.2f} / {step[1]:6.2f}  head {head[0]:6.2f} / "
            f"{head[1]:6.2f}  (step wall per round: {rounds})"
        )


def engine_pairs(models: dict, args) -> None:
    prompts = np.random.default_rng(0).integers(0, models["fp32"].config.vocab_size, (1, 16))
    pair = {"fp32": models["fp32"], "int8": models["int8"]}
    for model in pair.values():  # compile both shapes of both
        engine_rate(model, prompts, args.new)
    print(f"engine decode tokens/s, {args.new} new, alternating pairs:")
    ratios = []
    for i in range(args.pairs):
        rate = {name: engine_rate(model, prompts, args.new) for name, model in pair.items()}
        ratios.append(rate["int8"] / rate["fp32"])
        print(
            f"  pair {i + 1}: fp32 {rate['fp32']:.1f}  int8 {rate['int8']:.1f}  "
            f"int8/fp32 {ratios[-1]:.2f}x",
            flush=True,
        )
    print(f"  median int8/fp32 {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
