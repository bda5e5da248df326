"""Collectives in the compiled training step on an 8-device CPU mesh, against the design.

    python benchmarks/collectives.py        # sets XLA_FLAGS for 8 simulated devices itself

For each mesh, compiles eqllm's real train step (forward, backward, AdamW) for a small Llama
and counts the collective ops in the optimised HLO: in the entry computation (run once per step)
and in the scanned layer body (run once per layer). Then checks the kinds against what the
sharding rules predict:

- data only: gradients all-reduced; no weight all-gather, no reduce-scatter.
- fsdp: weights all-gathered before use and gradients reduce-scattered (or all-reduced and
  sliced, which XLA's CPU backend may prefer). Where the gathers sit matters for memory: inside
  the layer loop (ZeRO-3: one layer's weights whole at a time) or before it (all layers whole
  at once); the table shows which the partitioner chose.
- tensor: all-reduces inside the layer body (after the row-parallel o_proj and down projections,
  forward and backward); no all-gather of whole weights.
"""

import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqllm  # noqa: E402
from eqllm.recipe import OptimSpec  # noqa: E402
from eqllm.sharding import (  # noqa: E402
    MeshConfig,
    batch_sharding,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.train.optim import make_optimizer  # noqa: E402
from eqllm.train.step import TrainStep, init_opt_state  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
MESHES = ["data=8", "data=2,fsdp=4", "fsdp=8", "data=2,fsdp=2,tensor=2", "data=1,tensor=8"]
PREDICTED = {  # kind -> must appear (True) / must not appear (False); missing: either
    "data=8": {"all-reduce": True, "all-gather": False, "reduce-scatter": False},
    "data=2,fsdp=4": {"all-gather": True},
    "fsdp=8": {"all-gather": True},
    "data=2,fsdp=2,tensor=2": {"all-reduce": True, "all-gather": True},
    "data=1,tensor=8": {"all-reduce": True},
}


def count_collectives(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(counts in loop bodies, counts elsewhere) of each collective kind in optimised HLO text."""
    in_loop = dict.fromkeys(KINDS, 0)
    outside = dict.fromkeys(KINDS, 0)
    computation = ""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
        for kind in KINDS:
            if re.search(rf"= [^=]*\b{kind}(-start)?\(", line):
                (in_loop if computation in bodies else outside)[kind] += 1
    return in_loop, outside


def main() -> int:
    cfg = eqllm.zoo.config(
        "llama-nano",
        d_model=128,
        n_heads=8,
        n_kv_heads=8,
        d_ff=512,
        vocab_size=4096,
        max_seq_len=128,
        scan_layers=True,  # llama-nano unrolls its layers; the counts per layer need the scan
    )
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    print(
        f"llama-nano width {cfg.d_model}, {cfg.n_layers} scanned layers, batch 16 x seq 128, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, jax {jax.__version__}"
    )
    print(f"{'mesh':<24}{'where':<10}" + "".join(f"{k:>20}" for k in KINDS[:3]) + "  design")
    ok = True
    for text in MESHES:
        mesh = make_mesh(MeshConfig.parse(text))
        sharded, shardings = shard_model(model, mesh), param_shardings(model, mesh)
        optimizer = make_optimizer(OptimSpec(), 100, eqx.filter(sharded, eqx.is_array))
        opt_state = init_opt_state(optimizer, sharded, shardings)
        step = TrainStep(optimizer, lambda _: 1e-3, param_shardings=shardings)
        batch = jax.device_put(jnp.zeros((16, 129), jnp.int32), batch_sharding(mesh))
        hlo = step.lower(sharded, opt_state, batch).compile().compiled.as_text()
        in_loop, outside = count_collectives(hlo)
        verdicts = []
        for kind, expected in PREDICTED[text].items():
            present = (in_loop[kind] + outside[kind]) > 0
            verdicts.append(
                f"{kind} {'present' if present else 'absent'}"
                f"{'' if present == expected else ' (UNEXPECTED)'}"
            )
            ok &= present == expected
        for where, counts in (("layer", in_loop), ("step", outside)):
            cells = "".join(f"{counts[k]:>20}" for k in KINDS[:3])
            print(
                f"{text if where == 'layer' else '':<24}{where:<10}{cells}"
                + (f"  {'; '.join(verdicts)}" if where == "layer" else "")
            )
    print("all collectives as the design predicts" if ok else "MISMATCH with the design")
    return 0 if ok else 1


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
