"""A mixture of experts' compiled step, read again from its TPU HLO: the grouped-matmul kernels'
FLOPs as their cost estimates count them (every row of each block) and what their routed rows
run, beside the program's other matrix products and the model's FLOPs.

    eqllm plan RECIPE --json --dump-hlo step.hlo          # the compile (minutes at scale)
    PYTHONPATH=$PWD python benchmarks/moe_kernels.py step.hlo RECIPE CHIPS

RECIPE is the recipe the program was compiled from, as it was (its mesh, batch, sequence and
accumulation size the dispatch's blocks); CHIPS its slice's chip count. The other matrix
products are the dots and convolutions of the HLO at their loop trips (elementwise work is left
out); per chip per step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import equinox as eqx
import jax

import eqllm
from eqllm.bench.hlo import Program
from eqllm.model import CausalLM
from eqllm.plan.kernels import dispatch_block, grouped_cost, grouped_kernels
from eqllm.plan.step import planned_config
from eqllm.recipe import load_recipe
from eqllm.sharding.rules import RULES
from eqllm.train.mfu import step_flops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", type=Path)
    p.add_argument("recipe")
    p.add_argument("chips", type=int)
    args = p.parse_args(argv)
    eqllm.configure_process()  # libtpu is installed: keep JAX's probe of a TPU quiet
    recipe = load_recipe(args.recipe)
    sizes = recipe.mesh.axis_sizes(args.chips)
    config, experts = planned_config(recipe, sizes)
    tokens = recipe.train.batch_size * recipe.data.seq_len
    split = 1
    for axis in RULES["batch"]:
        split *= sizes[axis]
    rows = tokens // recipe.train.grad_accum // split
    program = Program(args.hlo.read_text())
    calls: dict[tuple[str, int], int] = {}
    for k in grouped_kernels(program):
        calls[(k.name, k.rows)] = calls.get((k.name, k.rows), 0) + k.runs
    g = grouped_cost(program, dispatch_block(config, sizes, rows))
    products = program.total("flops")
    shapes = eqx.filter_eval_shape(lambda: CausalLM(config, key=jax.random.key(0)))
    flops = step_flops(shapes, recipe.data.seq_len)
    model, hardware = (f * tokens / args.chips for f in (flops.model, flops.hardware))
    print(f"{recipe.name} on {sizes}, experts {experts}")
    print(
        "kernels per step: "
        + ", ".join(f"{n} {name} x {r:,} rows" for (name, r), n in calls.items())
    )
    print(f"block {g.block} rows, {g.routed} routed copies on the mean chip")
    print(f"kernels: {g.static:.3g} static, {g.run:.3g} run; other matrix products {products:.3g}")
    for label, kernels in (("static", g.static), ("run", g.run)):
        total = products + kernels
        print(
            f"{label}: {total:.3g} per chip, {total / model:.2f}x the model's {model:.3g} "
            f"({total / hardware:.2f}x with remat's recomputation, {hardware:.3g})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
