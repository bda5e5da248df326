"""Compile time of a Gemma 2-style model (local/global layers, soft-capping, four norms per
block) against a Llama-style one of the same width, at several depths.

    python benchmarks/compile_patterns.py [--layers 2 8 32] [--seq 256] [--batch 4] [--repeat 3]
        [--scanned llama-nano gemma2-nano] [--unrolled gemma2-nano]

Prints, for each depth, the seconds to lower and compile the training forward+backward
(`value_and_grad` of the loss) of the `--scanned` zoo variants (default `llama-nano` and
`gemma2-nano`, both d_model 128, 4 heads, d_ff 384) with their layers run by `lax.scan`, and of
the `--unrolled` ones with an unrolled layer loop for contrast; each figure is the fastest of
`--repeat` compilations (a shared machine adds noise, never speed). Gemma 2's layer pattern is a
per-layer flag scanned with the weights, so its compile time should stay as flat with depth as
Llama's; so should Gemma 3's (local/global with two RoPE bases) and SmolLM3's (NoPE layers),
`--scanned llama-nano gemma3-nano smollm3-nano`. Nothing is executed; the persistent compilation
cache is off.
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


def compile_seconds(cfg, batch: int, seq: int, repeat: int) -> float:
    return min(compile_once(cfg, batch, seq) for _ in range(repeat))


def compile_once(cfg, batch: int, seq: int) -> float:
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    params, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def value_and_grad(params, tokens):
        return eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), tokens)

    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(value_and_grad).lower(params, tokens).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scanned", nargs="+", default=["llama-nano", "gemma2-nano"])
    parser.add_argument("--unrolled", nargs="*", default=["gemma2-nano"])
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"batch {args.batch} x seq {args.seq}, fastest of "
        f"{args.repeat}, jax {jax.__version__} on {jax.devices()[0].device_kind}"
    )
    runs = [(name, True) for name in args.scanned] + [(name, False) for name in args.unrolled]
    columns = [
        f"{name.removesuffix('-nano')} {'scan' if scan else 'unrolled'} (s)" for name, scan in runs
    ]
    print(f"{'layers':>6}  " + "  ".join(f"{c:>19}" for c in columns))
    rows = []
    for n in args.layers:
        row = tuple(
            compile_seconds(
                eqllm.zoo.config(name, n_layers=n, scan_layers=scan, max_seq_len=args.seq),
                args.batch,
                args.seq,
                args.repeat,
            )
            for name, scan in runs
        )
        rows.append(row)
        print(f"{n:>6}  " + "  ".join(f"{s:>19.2f}" for s in row), flush=True)
    first, last = rows[0], rows[-1]
    ratios = ", ".join(
        f"{c.split(' (')[0]} {b / a:.2f}x" for c, a, b in zip(columns, first, last, strict=True)
    )
    print(f"{args.layers[-1]} layers / {args.layers[0]} layers: {ratios}")


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    main()
