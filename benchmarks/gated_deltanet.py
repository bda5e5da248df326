"""Gated DeltaNet: the chunked form against a scan over tokens, and its state against a KV cache.

    python benchmarks/gated_deltanet.py [--seqs 512 2048 8192] [--chunks 16 32 64 128]
        [--chunk-seq 2048] [--key-heads 4] [--heads 8] [--d-k 64] [--d-v 64] [--repeat 5]
        [--cpu N]

Part 1 times the two forms of the gated delta rule in `eqllm/nn/gated_deltanet.py` on one
sequence, fp32: `chunked` (the UT transform within chunks of 64 tokens, a `lax.scan` over
chunks) and `recurrent` (a `lax.scan` over tokens). For each length it gives the seconds to
lower and compile each jitted function, and the median of `--repeat` calls after one warm-up
(`block_until_ready`) of the forward and of the forward + backward (`jax.grad` of a scalar loss,
sum(out * c) for a fixed random c, with respect to q, k, v, g and beta); the two forms take
turns call by call so machine noise hits both alike, and XLA's memory analysis gives the
temporaries of each forward + backward. The inputs are as the layer makes them:
q (scaled by 1/sqrt(d_k)) and k of unit norm, g (log decay) uniform in (-1, 0), beta uniform in
(0, 1), a random starting state. Before timing, the largest absolute difference between the
forms' outputs, final states and gradients is printed, so the times compare the same values.
Then `chunked` alone at each `--chunks` size at length `--chunk-seq`, the multiply-adds per
token and head of each form (forward), and the time of the chunked form's UT transform (the
row-by-row inverse of each chunk's unit lower-triangular system and its two products) alone at
that length and chunk 64 against one of its batched products.

`--cpu N` pins the process to CPU N before JAX starts. On a machine shared with other jobs, XLA's
two worker threads wait on each other whenever one is descheduled: calls of one compiled
program took from 3 ms to 3 s on this 2-CPU machine; pinned to one CPU, a few times at most.

Part 2 is closed form, nothing runs: bytes per sequence of the cache of Qwen3-Next-80B-A3B
(transformers' `Qwen3NextConfig()` defaults) at 4k, 32k and 256k tokens, its hybrid layers
(full attention's K and V in bf16; the linear layers' `GatedDeltaNet.init_state`, conv inputs
in bf16 and the delta-rule state in fp32, its shapes from `jax.eval_shape`) against the same
depth with every layer full attention. Needs `transformers` (configuration only, no torch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm.nn import GatedDeltaNet
from eqllm.nn.gated_deltanet import chunked, recurrent, unit_lower_inverse

MiB = 1 << 20


def rule_inputs(seq, key_heads, heads, d_k, d_v, seed=0):
    """q, k, v, g, beta and a starting state for one sequence, as the layer would make them."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((seq, key_heads, d_k)) * d_k**-0.5
    k = unit((seq, key_heads, d_k))
    v = rng.normal(size=(seq, heads, d_v))
    g = -rng.uniform(0.0, 1.0, (seq, heads))
    beta = rng.uniform(0.0, 1.0, (seq, heads))
    state = 0.5 * rng.normal(size=(heads, d_k, d_v))
    cotangent = rng.normal(size=(seq, heads, d_v))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state, cotangent)]


def programs(rule):
    """The forward (outputs, final state) and the gradient of sum(out * c) w.r.t. q, k, v, g and
    beta."""

    def forward(q, k, v, g, beta, state, cotangent):
        return rule(q, k, v, g, beta, state)

    def loss(q, k, v, g, beta, state, cotangent):
        return jnp.sum(rule(q, k, v, g, beta, state)[0] * cotangent)

    return forward, jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def compiled(fn, args):
    """The compiled program and the seconds spent lowering and compiling it."""
    start = time.perf_counter()
    program = jax.jit(fn).lower(*args).compile()
    return program, time.perf_counter() - start


def timed(program, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    return time.perf_counter() - start


def temporaries(program) -> float:
    """MiB of temporaries XLA's memory analysis gives the compiled program (what the backward
    keeps from the forward among them)."""
    return program.memory_analysis().temp_size_in_bytes / MiB


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))


def medians(programs_by_name, args, repeat):
    """Median seconds per call of each program, after one warm-up call, calls taking turns."""
    times = {name: [] for name in programs_by_name}
    for program in programs_by_name.values():
        timed(program, args)  # warm-up
    for _ in range(repeat):
        for name, program in programs_by_name.items():
            times[name].append(timed(program, args))
    return {name: statistics.median(t) for name, t in times.items()}


def forms_table(args):
    print(
        f"\n## chunked (chunk {args.chunk}) against recurrent: {args.key_heads} key heads, "
        f"{args.heads} value heads, d_k {args.d_k}, d_v {args.d_v}, fp32, one sequence, "
        f"median of {args.repeat}\n"
    )
    print(
        "| tokens | max abs diff out / state / grads | compile fwd s chunked / recurrent "
        "| compile fwd+bwd s chunked / recurrent | fwd ms chunked | fwd ms recurrent "
        "| fwd speedup | fwd+bwd ms chunked | fwd+bwd ms recurrent | fwd+bwd speedup "
        "| fwd+bwd temporaries MiB chunked / recurrent |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    forms = {
        "chunked": lambda *a: chunked(*a, chunk_size=args.chunk),
        "recurrent": recurrent,
    }
    for seq in args.seqs:
        inputs = rule_inputs(seq, args.key_heads, args.heads, args.d_k, args.d_v)
        fwd, bwd, compile_s = {}, {}, {}
        for name, rule in forms.items():
            forward, grad = programs(rule)
            fwd[name], c_fwd = compiled(forward, inputs)
            bwd[name], c_bwd = compiled(grad, inputs)
            compile_s[name] = (c_fwd, c_bwd)
        out_c, state_c = fwd["chunked"](*inputs)
        out_r, state_r = fwd["recurrent"](*inputs)
        diffs = (
            max_diff([out_c], [out_r]),
            max_diff([state_c], [state_r]),
            max_diff(bwd["chunked"](*inputs), bwd["recurrent"](*inputs)),
        )
        t_fwd = medians(fwd, inputs, args.repeat)
        t_bwd = medians(bwd, inputs, args.repeat)
        c, r = compile_s["chunked"], compile_s["recurrent"]
        print(
            f"| {seq:,} | {diffs[0]:.1e} / {diffs[1]:.1e} / {diffs[2]:.1e} "
            f"| {c[0]:.2f} / {r[0]:.2f} | {c[1]:.2f} / {r[1]:.2f} "
            f"| {1e3 * t_fwd['chunked']:.1f} | {1e3 * t_fwd['recurrent']:.1f} "
            f"| {t_fwd['recurrent'] / t_fwd['chunked']:.1f}x "
            f"| {1e3 * t_bwd['chunked']:.1f} | {1e3 * t_bwd['recurrent']:.1f} "
            f"| {t_bwd['recurrent'] / t_bwd['chunked']:.1f}x "
            f"| {temporaries(bwd['chunked']):,.0f} / {temporaries(bwd['recurrent']):,.0f} |",
            flush=True,
        )


def chunks_table(args):
    seq = args.chunk_seq
    print(f"\n## chunked at {seq:,} tokens against its chunk size, median of {args.repeat}\n")
    print("| chunk | compile fwd s | compile fwd+bwd s | fwd ms | fwd+bwd ms |")
    print("|---|---|---|---|---|")
    inputs = rule_inputs(seq, args.key_heads, args.heads, args.d_k, args.d_v)
    for chunk in args.chunks:
        forward, grad = programs(lambda *a, chunk=chunk: chunked(*a, chunk_size=chunk))
        fwd, c_fwd = compiled(forward, inputs)
        bwd, c_bwd = compiled(grad, inputs)
        t = medians({"fwd": fwd, "bwd": bwd}, inputs, args.repeat)
        print(
            f"| {chunk} | {c_fwd:.2f} | {c_bwd:.2f} | {1e3 * t['fwd']:.1f} "
            f"| {1e3 * t['bwd']:.1f} |",
            flush=True,
        )


def macs_per_token(chunk: int | None, d_k: int, d_v: int) -> int:
    """Forward multiply-adds per token and value head: the scan over tokens (chunk None) reads
    and corrects S (k^T S, the rank-1 update, q^T S); the chunked form adds, per token, a row of
    each chunk-square product (k k^T, q k^T, attention times the written values), its row of the
    UT transform's inverse (`unit_lower_inverse`: one row times the whole chunk x chunk matrix)
    and a row of the two products with that inverse, to the same three state products."""
    state = 3 * d_k * d_v
    if chunk is None:
        return state
    return state + chunk * (2 * d_k + d_v) + chunk * chunk + chunk * (d_k + d_v)


def ut_share(args):
    """The chunked form's UT transform alone (the inverse of each chunk's unit lower-triangular
    system, row by row, and its products with the values and the keys) against one of its
    batched products."""
    chunk, seq = 64, args.chunk_seq
    n, heads, d_k, d_v = seq // chunk, args.heads, args.d_k, args.d_v
    rng = np.random.default_rng(0)
    lower = np.tril(0.1 * rng.normal(size=(n, heads, chunk, chunk)), -1)
    system = jnp.asarray(lower, jnp.float32)
    keys = jnp.asarray(rng.normal(size=(n, heads, chunk, d_k)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(n, heads, chunk, d_v)), jnp.float32)

    def transform(system, keys, values):
        inverse = unit_lower_inverse(system)
        return inverse @ values, inverse @ keys

    def product(system, keys, values):
        return jnp.einsum("nhid,nhjd->nhij", keys, keys)

    inputs = (system, keys, values)
    t = medians(
        {
            name: compiled(f, inputs)[0]
            for name, f in (("transform", transform), ("product", product))
        },
        inputs,
        args.repeat,
    )
    ut_macs = n * heads * (chunk**3 + chunk * chunk * (d_k + d_v))
    product_macs = n * heads * chunk * chunk * d_k
    print(
        f"\nat {seq:,} tokens, chunk {chunk}: the UT transform alone (row-by-row inverse and "
        f"its two products) {1e3 * t['transform']:.1f} ms "
        f"({2 * ut_macs / t['transform'] / 1e9:.1f} GFLOP/s); "
        f"one batched product k k^T {1e3 * t['product']:.1f} ms "
        f"({2 * product_macs / t['product'] / 1e9:.1f} GFLOP/s)"
    )
    per_token = ", ".join(f"chunk {c} {macs_per_token(c, d_k, d_v):,}" for c in args.chunks)
    print(
        f"forward multiply-adds per token and head: recurrent "
        f"{macs_per_token(None, d_k, d_v):,}; chunked: {per_token}"
    )


def cache_bytes(config, tokens: int, hybrid: bool) -> dict[str, int]:
    """Bytes per sequence of a Qwen3-Next-style cache after `tokens` tokens.

    Full-attention layers hold K and V of every token in bf16; with `hybrid`, the linear layers
    (config.layer_types) hold what `GatedDeltaNet.init_state` holds, conv inputs in bf16.
    """
    kinds = config.layer_types if hybrid else ["full_attention"] * config.num_hidden_layers
    n_attention = kinds.count("full_attention")
    n_linear = len(kinds) - n_attention
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    layer = eqx.filter_eval_shape(
        GatedDeltaNet,
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        key=jax.random.key(0),
    )
    state = jax.eval_shape(lambda: layer.init_state(dtype=jnp.bfloat16))
    conv = state.conv.size * state.conv.dtype.itemsize
    rule = state.recurrent.size * state.recurrent.dtype.itemsize
    return {
        "attention": n_attention * kv_per_token * tokens,
        "conv": n_linear * conv,
        "rule": n_linear * rule,
    }


def state_table(contexts):
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig()
    kinds = config.layer_types
    print(
        f"\n## cache bytes per sequence, Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig()): "
        f"{config.num_hidden_layers} layers, {kinds.count('full_attention')} full attention "
        f"(every {kinds.index('full_attention') + 1}th; {config.num_key_value_heads} KV heads of "
        f"{config.head_dim}, bf16), {kinds.count('linear_attention')} Gated DeltaNet "
        f"({config.linear_num_key_heads} key heads, {config.linear_num_value_heads} value heads, "
        f"d_k {config.linear_key_head_dim}, d_v {config.linear_value_head_dim}, conv kernel "
        f"{config.linear_conv_kernel_dim})\n"
    )
    per_layer = cache_bytes(config, 0, True)
    n_linear = kinds.count("linear_attention")
    kv_token = cache_bytes(config, 1, False)["attention"] // config.num_hidden_layers
    print(
        f"one Gated DeltaNet layer: conv {per_layer['conv'] // n_linear:,} B (bf16) + delta-rule "
        f"state {per_layer['rule'] // n_linear:,} B (fp32); one attention layer: "
        f"{kv_token:,} B per token\n"
    )
    print(
        "| context | hybrid: attention KV MiB | hybrid: conv MiB | hybrid: delta-rule state MiB "
        "| hybrid total MiB | all full attention MiB | all-attention / hybrid |"
    )
    print("|---|---|---|---|---|---|---|")
    for tokens in contexts:
        hybrid = cache_bytes(config, tokens, True)
        full = sum(cache_bytes(config, tokens, False).values())
        total = sum(hybrid.values())
        print(
            f"| {tokens // 1024}k | {hybrid['attention'] / MiB:,.1f} | {hybrid['conv'] / MiB:,.2f} "
            f"| {hybrid['rule'] / MiB:,.1f} | {total / MiB:,.1f} | {full / MiB:,.1f} "
            f"| {full / total:.2f}x |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="*", default=[512, 2048, 8192])
    parser.add_argument("--chunk", type=int, default=64, help="chunk size of the forms table")
    parser.add_argument("--chunks", type=int, nargs="*", default=[16, 32, 64, 128])
    parser.add_argument("--chunk-seq", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-k", type=int, default=64)
    parser.add_argument("--d-v", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768, 262144])
    parser.add_argument("--cpu", type=int, help="pin the process to this CPU (default: all)")
    args = parser.parse_args()
    if args.cpu is not None:  # before JAX starts its threads, so they inherit it
        os.sched_setaffinity(0, {args.cpu})
    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    print(
        f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.devices()[0].device_kind}, "
        f"CPUs {sorted(os.sched_getaffinity(0))} of {os.cpu_count()}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)"
    )
    if args.seqs:
        forms_table(args)
    if args.chunks:
        chunks_table(args)
        ut_share(args)
    if args.contexts:
        state_table(args.contexts)
    print(
        f"\nload average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min); "
        f"{time.perf_counter() - start:.0f} s in all"
    )


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    main()
