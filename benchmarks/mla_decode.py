"""Multi-head latent attention: KV-cache bytes per token against grouped-query attention, and
batch-1 decode speed with the up-projections absorbed against expanded keys and values.

The cache of a latent layer holds kv_lora_rank + qk_rope_head_dim numbers per token; the same
model with grouped-query (here multi-head) attention caches 2 * kv_heads * head_dim. Decode is
one sequence, a prompt prefilled, then one compiled scan of `--new` steps (compilation timed
apart); random weights, fp32 on CPU.

    PYTHONPATH=$PWD python benchmarks/mla_decode.py [--model deepseek-v3] [--prompt 1024]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm.nn import MultiHeadLatentAttention


def cache_bytes_per_token(cfg: eqllm.ModelConfig, dtype_bytes: int = 2) -> tuple[int, int]:
    """(latent, GQA) cache bytes per token over all layers, at `dtype_bytes` per number."""
    a = cfg.attention
    latent = (a.kv_lora_rank + a.qk_rope_head_dim) * cfg.n_layers * dtype_bytes
    gqa = a.n_kv_heads * (a.head_dim + a.v_head_dim) * cfg.n_layers * dtype_bytes
    return latent, gqa


def decode_rate(model, prompt: int, new: int) -> tuple[float, float]:
    """(tokens/s of the decode steps alone, their compile seconds) for one sequence."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, prompt))

    @eqx.filter_jit
    def prefill(model, tokens):
        logits, cache = model.prefill(tokens, jnp.arange(prompt), model.init_cache(prompt + new))
        return jnp.argmax(logits).astype(jnp.int32), cache

    @eqx.filter_jit
    def decode(model, first, cache):
        def step(carry, i):
            token, cache = carry
            logits, cache = model.decode(token, i, cache)
            return (jnp.argmax(logits).astype(jnp.int32), cache), None

        return jax.lax.scan(step, (first, cache), prompt + jnp.arange(new))[0][0]

    first, cache = prefill(model, tokens)
    start = time.perf_counter()
    decode(model, first, cache).block_until_ready()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    decode(model, first, cache).block_until_ready()
    return new / (time.perf_counter() - start), compile_s


def with_absorb(model, absorb: bool):
    def swap(node):
        return node.with_absorb(absorb) if isinstance(node, MultiHeadLatentAttention) else node

    is_mla = lambda n: isinstance(n, MultiHeadLatentAttention)  # noqa: E731
    return jax.tree.map(swap, model, is_leaf=is_mla)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v3", help="zoo size for the cache figures")
    parser.add_argument("--bench-model", default="deepseek_v3-nano")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    cfg = eqllm.zoo.config(args.model)
    latent, gqa = cache_bytes_per_token(cfg)
    print(f"{args.model}: KV cache per token, bf16, all {cfg.n_layers} layers")
    print(f"  latent + rotary key: {latent:,} bytes; multi-head ({cfg.attention.n_kv_heads} kv "
          f"heads of {cfg.attention.head_dim}/{cfg.attention.v_head_dim}): {gqa:,} bytes "
          f"({gqa / latent:.1f}x)")  # fmt: skip
    bench = eqllm.zoo.config(
        args.bench_model,
        d_model=args.d_model,
        max_seq_len=args.prompt + args.new,
        moe=None,
        attention={"n_heads": args.heads, "n_kv_heads": args.heads, "kv_lora_rank": 128,
                   "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                   "head_dim": 96, "q_lora_rank": 128},
    )  # fmt: skip
    model = eqllm.CausalLM(bench, key=jax.random.key(0))
    platform = jax.devices()[0].platform
    print(f"decode, {args.bench_model} at d_model {args.d_model}, {args.heads} heads, dense MLP, "
          f"prompt {args.prompt}, {args.new} new tokens, batch 1, fp32, {platform}")  # fmt: skip
    for absorb in (True, False):
        rate, compile_s = decode_rate(with_absorb(model, absorb), args.prompt, args.new)
        name = "absorbed" if absorb else "expanded"
        print(f"  {name:<9} {rate:8.1f} tokens/s  (compile {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
