"""Forms of an int8-weight product on CPU: one [rows, d] x [d, 4d] product per layer, over as many
layers as smollm-135m (30 of d=576) or smollm-360m (32 of d=960), random weights.

Each layer's weight is read once per call, as in a decode step, and all of them together exceed
the CPU's caches (as a model's do), unlike one product timed in a loop. The layers run unrolled
(as the engine's decode step runs them) or under `lax.scan` (`--scan`). Forms:

- fp32: the fp32 weight.
- widen: `x @ w8.astype(f32).T * scale`, as `Int8Linear` computed it before: nothing orders the
  widening after the layer's input.
- preferred: `lax.dot_general(x, w8, preferred_element_type=f32) * scale` (mixed operands).
- int8xint8: the activations quantized per row (dynamic scale), `lax.dot_general` of two int8
  operands accumulating in int32, both scales applied to the result.
- ordered: `eqllm.nn.Int8Linear` as it is now: widening after a zero computed from the input.

Prints milliseconds per call (best of 3) and the largest error against fp32, relative to the
largest |fp32 output|.

    PYTHONPATH=$PWD python benchmarks/int8_product.py [--rows 1] [--scan] [--forms ...]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

from eqllm.nn import Int8Linear, Linear

SIZES = {"smollm-135m": (576, 30), "smollm-360m": (960, 32)}
CONTRACT = (((1,), (1,)), ((), ()))  # rows x in  .  out x in


def product(form: str, x, layer: Int8Linear, w32):
    """One layer's [rows, d] x [d, 4d] product in `form`."""
    w8, scale = layer.weight, layer.scale
    if form == "fp32":
        return x @ w32.T
    if form == "widen":
        return (x @ w8.astype(x.dtype).T) * scale
    if form == "preferred":
        return lax.dot_general(x, w8, CONTRACT, preferred_element_type=jnp.float32) * scale
    if form == "int8xint8":
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        a = jnp.where(amax > 0, amax / 127.0, 1.0)
        xq = jnp.clip(jnp.round(x / a), -127, 127).astype(jnp.int8)
        acc = lax.dot_general(xq, w8, CONTRACT, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * a * scale
    if form == "ordered":
        return layer(x)
    raise ValueError(form)


def compiled(form: str, x, int8: list, weights: list, scan: bool):
    """The jitted product of every layer in order, and its arguments."""
    d = x.shape[-1]

    def one(h, layer, w32):  # a residual update, so each layer waits for the one before
        return h + 1e-3 * product(form, h, layer, w32)[:, :d]

    if scan:

        def scanned(x, stacked, w32):
            return lax.scan(lambda h, lw: (one(h, *lw), None), x, (stacked, w32))[0]

        stacked = jax.tree.map(lambda *a: jnp.stack(a), *int8)
        return jax.jit(scanned), (x, stacked, jnp.stack(weights))

    def unrolled(x, layers, w32):
        for layer, w in zip(layers, w32, strict=True):
            x = one(x, layer, w)
        return x

    return jax.jit(unrolled), (x, int8, weights)


def timed(f, *args) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(5):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / 5)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument(
        "--forms", nargs="+", default=["fp32", "widen", "preferred", "int8xint8", "ordered"]
    )
    args = parser.parse_args()
    for size in args.sizes:
        d, n = SIZES[size]
        keys = jax.random.split(jax.random.key(0), n)
        fp32 = [Linear(d, 4 * d, axes=("d_ff", "d_model"), key=k) for k in keys]
        int8 = [Int8Linear(layer) for layer in fp32]
        weights = [layer.weight for layer in fp32]
        x = jax.random.normal(jax.random.key(1), (args.rows, d))

        f, call = compiled("fp32", x, int8, weights, args.scan)
        want = f(*call) - x
        cells = []
        for form in args.forms:
            f, call = compiled(form, x, int8, weights, args.scan)
            error = float(jnp.max(jnp.abs(f(*call) - x - want)) / jnp.max(jnp.abs(want)))
            cells.append(f"{form} {timed(f, *call):.2f} ms (err {error:.0e})")
        mb = n * 4 * d * d * 4 / 1e6
        layout = "scanned" if args.scan else "unrolled"
        print(f"{size} ({n} x [{d}, {4 * d}], {mb:.0f} MB fp32, {layout}, rows {args.rows}):")
        print("  " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
