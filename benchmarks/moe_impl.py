"""Dense against grouped ("ragged") experts: forward + backward of the training loss, same model.

    python benchmarks/moe_impl.py [--variant mixtral-nano --batch 16 --seq 256 --calls 10]

Times `jax.jit(jax.grad(training_loss))` of the variant with `moe_impl="dense"` (every expert
on every token, combined by a [tokens, experts] matrix) and `moe_impl="ragged"` (token copies
sorted by expert, `jax.lax.ragged_dot`), with the same weights and batch. The two run
alternately, call by call, so machine noise hits both alike; the figure printed is the median
per call. Compile time is left out (the first call of each).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm.train.step import training_loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="mixtral-nano")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    cfg = eqllm.zoo.config(args.variant)
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    batch = jax.numpy.asarray(batch, jax.numpy.int32)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, b: training_loss(m, b)[0]))
    models = {impl: model.with_config(moe={"impl": impl}) for impl in ("dense", "ragged")}
    times: dict[str, list[float]] = {impl: [] for impl in models}
    for m in models.values():  # compile
        jax.block_until_ready(grad(m, batch))
    for _ in range(args.calls):
        for impl, m in models.items():
            t0 = time.perf_counter()
            jax.block_until_ready(grad(m, batch))
            times[impl].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    print(f"{args.variant}, batch {args.batch} x {args.seq}, {jax.devices()[0].device_kind}:")
    for impl, t in times.items():
        med = float(np.median(t))
        print(f"  {impl:6s} {med * 1e3:8.1f} ms/step  {tokens / med:10,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
