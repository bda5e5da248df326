"""Token dispatch against dense experts on a mesh: the training step's time, same model and batch.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python benchmarks/moe_dispatch.py [--mesh data=2,fsdp=4 --batch 8 --seq 128 --calls 5]
        [--capacity-factor 1.0]

Times one `TrainStep` (forward, backward, AdamW) of the variant (8 experts, so that fsdp=8
divides them too) on the mesh with `moe.impl="dense"` (expert-parallel or FSDP over experts, as
`eqllm.sharding.FsdpGather` chooses) and `moe.impl="dispatch"` (each token copy sent to its
expert's device and back by all-to-all, local experts as one `ragged_dot`). They run
alternately, call by call, so machine noise hits both alike; the figure is the median per call,
compile time (the first call) printed apart.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm.recipe import OptimSpec
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="mixtral-nano")
    parser.add_argument("--mesh", default="data=2,fsdp=4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--impls", default="dense,dispatch")
    parser.add_argument("--capacity-factor", type=float, help="also time dispatch with it")
    args = parser.parse_args(argv)
    mesh = make_mesh(MeshConfig.parse(args.mesh))
    cfg = eqllm.zoo.config(args.variant, scan_layers=True, moe={"n_experts": 8})
    spec = OptimSpec(lr=1e-3, warmup_steps=0)
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    batch = jax.device_put(np.asarray(batch, np.int32), batch_sharding(mesh))
    runs, times = {}, {}
    variants = {impl: {"moe.impl": impl} for impl in args.impls.split(",")}
    if args.capacity_factor is not None:
        cf = {"moe.impl": "dispatch", "moe.capacity_factor": args.capacity_factor}
        variants[f"dispatch, capacity {args.capacity_factor}"] = cf
    for impl, overrides in variants.items():
        model = eqllm.CausalLM(cfg.replace(**overrides), key=jax.random.key(0))
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
        optimizer = make_optimizer(spec, 100, eqx.filter(model, eqx.is_inexact_array))
        opt_state = init_opt_state(optimizer, model, shardings)
        step = TrainStep(optimizer, schedule(spec, 100), param_shardings=shardings)
        t0 = time.perf_counter()
        model, opt_state, metrics = step(model, opt_state, batch)
        jax.block_until_ready(metrics["loss"])
        runs[impl] = [step, model, opt_state]
        times[impl] = [time.perf_counter() - t0]  # the first call: compile and run
    for _ in range(args.calls):
        for impl, run in runs.items():
            step, model, opt_state = run
            t0 = time.perf_counter()
            model, opt_state, metrics = step(model, opt_state, batch)
            jax.block_until_ready(metrics["loss"])
            times[impl].append(time.perf_counter() - t0)
            run[1:] = [model, opt_state]
    tokens = args.batch * args.seq
    print(f"{args.variant} (8 experts), {args.mesh}, batch {args.batch} x {args.seq}:")
    for impl, t in times.items():
        med = float(np.median(t[1:]))
        print(
            f"  {impl:24s} {med * 1e3:8.1f} ms/step  {tokens / med:10,.0f} tokens/s"
            f"  (first call {t[0]:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
