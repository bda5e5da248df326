"""Compile time of the training forward+backward against depth: scanned vs unrolled layers.

    python benchmarks/compile_depth.py [--variant llama-micro] [--layers 2 8 32] [--seq 128]

Prints, for each depth, the seconds to lower and compile `value_and_grad(loss)` for a model of
the variant's width, with the layers run by `lax.scan` and by a Python loop (whatever the
variant's own `scan_layers`: the research-size variants unroll theirs).
Nothing is executed, so the figures are compile cost alone; the persistent cache is off.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqllm


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def compile_seconds(cfg, batch: int, seq: int) -> float:
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    params, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def value_and_grad(params, tokens):
        return eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), tokens)

    start = time.perf_counter()
    jax.jit(value_and_grad).lower(params, tokens).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="llama-micro")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"{args.variant} width, batch {args.batch} x seq {args.seq}, jax {jax.__version__} "
        f"on {jax.devices()[0].device_kind}"
    )
    print(f"{'layers':>6}  {'scan (s)':>9}  {'unrolled (s)':>12}")
    rows = []
    for n in args.layers:
        cfg = eqllm.zoo.config(args.variant, n_layers=n, scan_layers=True)
        scan = compile_seconds(cfg, args.batch, args.seq)
        unrolled = compile_seconds(cfg.replace(scan_layers=False), args.batch, args.seq)
        rows.append((n, scan, unrolled))
        print(f"{n:>6}  {scan:>9.2f}  {unrolled:>12.2f}", flush=True)
    first, last = rows[0], rows[-1]
    print(
        f"scan: {last[0]} layers / {first[0]} layers = {last[1] / first[1]:.2f}x; "
        f"unrolled: {last[2] / first[2]:.2f}x"
    )


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    main()
