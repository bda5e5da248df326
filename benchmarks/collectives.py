"""Collectives in the compiled training step on an 8-device CPU mesh, against the design.

    python benchmarks/collectives.py        # sets XLA_FLAGS for 8 simulated devices itself

For each mesh, compiles eqllm's real train step (forward, backward, AdamW) for a small Llama
and counts the collective ops in the optimised HLO
(`eqllm.bench.collectives.count_collectives`): per layer (inside the scanned layer loop's bodies,
forward and backward) and per step (every op times the trip counts of its loops). Then checks
them against what the sharding rules predict:

- data only: gradients all-reduced; no weight all-gather, no reduce-scatter.
- fsdp: each layer's weights all-gathered inside the layer loop (ZeRO-3: one layer whole at a
  time; `eqllm.sharding.fsdp`), and its gradient reduced inside the backward loop (a
  reduce-scatter, or on XLA's CPU backend an all-reduce of the layer and a slice).
- tensor: all-reduces inside the layer body (after the row-parallel o_proj and down projections,
  forward and backward); no all-gather of whole weights inside the layers.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import eqllm  # noqa: E402
from eqllm.bench.collectives import KINDS  # noqa: E402
from eqllm.bench.mesh import mesh_bench  # noqa: E402

MESHES = ["data=8", "data=2,fsdp=4", "fsdp=8", "data=2,fsdp=2,tensor=2", "data=1,tensor=8"]
PREDICTED = {  # (where, kind) -> must appear (True) / must not appear (False); missing: either
    "data=8": {("step", "all-reduce"): True, ("step", "all-gather"): False},
    "data=2,fsdp=4": {("layer", "all-gather"): True, ("layer", "reduce"): True},
    "fsdp=8": {("layer", "all-gather"): True, ("layer", "reduce"): True},
    "data=2,fsdp=2,tensor=2": {("layer", "all-gather"): True, ("layer", "all-reduce"): True},
    "data=1,tensor=8": {("layer", "all-reduce"): True, ("layer", "all-gather"): False},
}


def main() -> int:
    cfg = eqllm.zoo.config(
        "llama-nano",
        d_model=128,
        attention={"n_heads": 8, "n_kv_heads": 8},
        mlp={"d_ff": 512},
        vocab_size=4096,
        max_seq_len=128,
        scan_layers=True,  # llama-nano unrolls its layers; the counts per layer need the scan
    )
    print(
        f"llama-nano width {cfg.d_model}, {cfg.n_layers} scanned layers, batch 16 x seq 128, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, jax {jax.__version__}"
    )
    print(f"{'mesh':<24}{'where':<7}" + "".join(f"{k:>16}" for k in KINDS[:3]) + "  design")
    ok = True
    for text in MESHES:
        r = mesh_bench("llama-nano", cfg, text, batch=16, seq=128)
        counts = {"layer": r.per_layer, "step": r.per_step}
        verdicts = []
        for (where, kind), expected in PREDICTED[text].items():
            c = counts[where]
            n = c["all-reduce"] + c["reduce-scatter"] if kind == "reduce" else c[kind]
            verdicts.append(
                f"{kind} per {where} {'present' if n else 'absent'}"
                f"{'' if bool(n) == expected else ' (UNEXPECTED)'}"
            )
            ok &= bool(n) == expected
        for where in ("layer", "step"):
            cells = "".join(f"{counts[where][k]:>16}" for k in KINDS[:3])
            print(
                f"{text if where == 'layer' else '':<24}{where:<7}{cells}"
                + (f"  {'; '.join(verdicts)}" if where == "layer" else "")
            )
    print("all collectives as the design predicts" if ok else "MISMATCH with the design")
    return 0 if ok else 1


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
