"""The stacked Transformer blocks: built from a ModelConfig and run in order by `lax.scan`.

Every layer is the same Block (`eqllm.nn.Block`), its arrays stacked on a leading `layers` axis
so one compiled body serves any depth (Levanter, MaxText do the same). What differs between
layers, the local/global attention pattern of Gemma 2 and 3 and OLMo 3 (with its own RoPE base)
and SmolLM3's layers without rotary embedding (NoPE), are per-layer flags scanned alongside the
weights rather than second stacks or an unrolled loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqllm.attention_backend import attention_kernel
from eqllm.config import ModelConfig
from eqllm.config.experts import choose_impl
from eqllm.nn import (
    MLP,
    Attention,
    Block,
    GatedMLP,
    LayerNorm,
    MoE,
    MultiHeadLatentAttention,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    Routing,
)
from eqllm.parametrization import scales

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Applied to each layer's Block inside the layer loop's body (see `each_layer`): returns what
# runs in the block's place, called as block(x, positions, local, segment_ids, rotate).
LayerHook = Callable[[Block], Callable]
_LAYER_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar(
    "eqllm_layer_hook", default=None
)


@contextlib.contextmanager
def each_layer(hook: LayerHook) -> Iterator[None]:
    """While tracing inside this context, `run_blocks` runs `hook(block)` in place of each
    layer's Block, inside the loop body (scanned or unrolled); the hook's result is called like
    `Block.routed`, `(x, positions, local, segment_ids, rotate) -> (x, routing)`.

    This is how FSDP gathers one layer's weights at a time (`eqllm.sharding.FsdpGather`):
    sharding constraints placed here stay inside the loop, where XLA otherwise gathers every
    layer before it. Without remat, the backward pass keeps every intermediate of the body but
    the outputs of sharding constraints and custom-gradient calls (the gathered weights), and
    recomputes those from the layer's split arrays.
    """
    token = _LAYER_HOOK.set(hook)
    try:
        yield
    finally:
        _LAYER_HOOK.reset(token)


def _save_all_but_gathers(prim, *_, **__) -> bool:
    """A remat policy that keeps every intermediate except the outputs of sharding constraints
    and custom-gradient calls (the gathered weights of `each_layer`): the backward pass gathers
    them again, one layer at a time, rather than keeping every layer's whole weights."""
    return prim.name not in ("sharding_constraint", "custom_vjp_call", "custom_vjp_call_jaxpr")


def dtype_of(name: str):
    """The jax dtype of a ModelConfig dtype name ("bfloat16" -> jnp.bfloat16)."""
    return _DTYPES[name]


def make_norm(config: ModelConfig, dtype) -> RMSNorm | LayerNorm:
    """The config's norm over d_model (every norm of the model but the QK-norm)."""
    norms = config.norms
    if norms.kind == "rmsnorm":
        return RMSNorm(config.d_model, eps=norms.eps, plus_one=norms.plus_one, dtype=dtype)
    return LayerNorm(config.d_model, eps=norms.eps, use_bias=norms.bias, dtype=dtype)


def make_rope(config: ModelConfig) -> RotaryEmbedding | None:
    """The rotary embedding `config.positions` describes (None without RoPE)."""
    pos = config.positions
    if pos.kind != "rope":
        return None
    scaling = None
    if (s := pos.scaling) is not None:
        values = {k: getattr(s, k) for k in s.__pydantic_fields__ if getattr(s, k) is not None}
        if s.kind == "longrope" and s.factor is None:  # transformers' default for Phi-3
            values["factor"] = config.max_seq_len / s.original_max_seq_len
        scaling = RopeScaling(**values)
    if config.attention.kind == "mla":  # only the qk_rope_head_dim part rotates
        return RotaryEmbedding(config.rotary_dim, pos.theta, scaling=scaling)
    return RotaryEmbedding(
        config.head_dim,
        pos.theta,
        scaling=scaling,
        local_theta=pos.local_theta,
        rotary_dim=None if pos.fraction == 1 else config.rotary_dim,
    )


def mla_scale(config: ModelConfig) -> float:
    """Latent attention's softmax scale: 1 / sqrt(qk head size), times the square of YaRN's
    mscale(factor, mscale_all_dim) where the RoPE scaling sets mscale_all_dim (transformers'
    `yarn_apply_mscale` for DeepSeek)."""
    scale = config.head_dim**-0.5
    s = config.positions.scaling
    if s is not None and s.mscale_all_dim and s.factor > 1:
        m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
        scale = scale * m * m
    return scale


def make_attention(config: ModelConfig, key: PRNGKeyArray, dtype):
    """The attention layer of a block: grouped-query or latent (`attention.kind`)."""
    a, norms = config.attention, config.norms
    if a.kind == "mla":
        return MultiHeadLatentAttention(
            config.d_model,
            a.n_heads,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            q_lora_rank=a.q_lora_rank,
            bias=a.qkv_bias,
            rope=make_rope(config),
            interleaved=a.rope_interleave,
            scale=mla_scale(config),
            norm_eps=1e-6,  # transformers' latent norms keep their default eps, not rms_norm_eps
            key=key,
            dtype=dtype,
        )
    scalar = a.query_pre_attn_scalar
    s = scales(config)
    scale = None if scalar is None else scalar**-0.5
    if s.attention != 1.0:  # muP: scores ~ 1 / head_dim when head_dim grows with width
        scale = (config.head_dim**-0.5 if scale is None else scale) * s.attention
    return Attention(
        config.d_model,
        a.n_heads,
        n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        qkv_bias=a.qkv_bias,
        out_bias=a.out_bias,
        qk_norm=a.qk_norm is not None,
        qk_norm_per_head=a.qk_norm != "whole",
        norm_plus_one=norms.plus_one,
        rope=make_rope(config),
        sliding_window=a.sliding_window,
        norm_eps=norms.eps,
        scale=scale,
        softcap=a.softcap,
        sinks=a.sinks,
        kernel=attention_kernel(config),
        key=key,
        dtype=dtype,
    )


def make_block(config: ModelConfig, key: PRNGKeyArray, *, dense: bool = False) -> Block:
    """One Transformer block as `config` describes it (`dense`: with the dense MLP even in a
    mixture of experts, one of its first `moe.dense_layers` layers)."""
    dtype = dtype_of(config.param_dtype)
    k_attn, k_mlp = jax.random.split(key)
    norms = config.norms
    s = scales(config)
    attn = make_attention(config, k_attn, dtype)
    if (moe := config.moe) is not None and not dense:
        mlp = MoE(
            config.d_model,
            config.expert_d_ff,
            moe.n_experts,
            moe.experts_per_token,
            normalize=moe.norm_topk_prob,
            shared_d_ff=moe.shared_d_ff,
            impl=choose_impl(  # "auto" without a mesh; a run chooses again with its mesh
                moe.impl, backend=jax.default_backend(), expert_shards=1, n_experts=moe.n_experts
            )[0],
            capacity_factor=moe.capacity_factor,
            bias=moe.bias,
            activation=moe.activation,
            swiglu_alpha=moe.swiglu_alpha,
            swiglu_limit=moe.swiglu_limit,
            shared_gated=moe.shared_gated,
            scoring=moe.scoring,
            score_bias=moe.score_bias,
            n_groups=moe.n_groups,
            topk_groups=moe.topk_groups,
            group_score=moe.group_score,
            routed_scale=moe.routed_scale,
            key=k_mlp,
            dtype=dtype,
        )
    elif config.mlp.kind == "gelu":
        mlp = MLP(
            config.d_model,
            config.mlp.d_ff,
            use_bias=config.mlp.bias,
            approximate=config.mlp.gelu == "tanh",
            key=k_mlp,
            dtype=dtype,
        )
    else:
        activation = "silu" if config.mlp.kind == "swiglu" else "gelu"
        mlp = GatedMLP(
            config.d_model,
            config.mlp.d_ff,
            activation=activation,
            use_bias=config.mlp.bias,
            key=k_mlp,
            dtype=dtype,
        )

    def norm(wanted: bool):
        return make_norm(config, dtype) if wanted else None

    pre, post = norms.pre, norms.post
    return Block(
        norm(pre), attn, norm(pre), mlp, norm(post), norm(post), s.branch, config.parallel_residual
    )


def run_blocks(
    blocks: Block,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    first: int = 0,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply the stacked blocks in order: `lax.scan` or an unrolled Python loop (see below).

    `positions` None means 0..seq-1 (see `Attention.__call__`); `segment_ids` (None: one
    segment) keep every layer's attention inside each packed document. A model whose layers differ
    (`layer_flags`) scans the flags alongside the weights: one compiled body for every layer.
    `first`: the model's index of the stack's first layer (a mixture of experts after a dense
    prefix). Returns the output and, for a mixture of experts, every layer's `Routing` (router
    logits and dropped copies, stacked on a leading layers axis; else None).
    """
    params, static = eqx.partition(blocks, eqx.is_array)
    n_layers = jax.tree.leaves(params)[0].shape[0]
    local, rotate = (
        None if f is None else f[first : first + n_layers] for f in layer_flags(config)
    )
    xs = (params, _traced(local), _traced(rotate))

    hook = _LAYER_HOOK.get()

    def step(h, layer):
        layer_params, layer_local, layer_rotate = layer
        block = eqx.combine(layer_params, static)
        if hook is not None:
            return hook(block)(h, positions, layer_local, segment_ids, layer_rotate)
        return block.routed(h, positions, layer_local, segment_ids, layer_rotate)

    if config.remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[config.remat])
    elif hook is not None:
        step = jax.checkpoint(step, policy=_save_all_but_gathers)
    # Remat needs the loop: unrolled, XLA computes each block's recomputation as early as its
    # input exists, so the activations live as long as without remat (llama-mini at 2 x 256:
    # 480 MiB unrolled vs 360 MiB scanned, 493 / 449 MiB without remat).
    if config.scan_layers or config.remat != "none":
        return jax.lax.scan(step, x, xs)
    routings = []
    for i in range(n_layers):  # each layer's flags are known here: Python bools
        flags = (layer_flag(local, i), layer_flag(rotate, i))
        x, routing = step(x, (jax.tree.map(lambda a, i=i: a[i], params), *flags))
        routings.append(routing)
    if routings[0] is None:
        return x, None
    return x, jax.tree.map(lambda *layers: jnp.stack(layers), *routings)


def run_stacks(
    dense_blocks: Block | None,
    blocks: Block,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """`run_blocks` over a dense prefix (`moe.dense_layers` layers, None: none) and then the
    main stack: two scanned segments, each one compiled body. The `Routing` is that of the
    main stack's layers."""
    if dense_blocks is not None:
        x, _ = run_blocks(dense_blocks, x, positions, config, segment_ids)
    first = 0 if dense_blocks is None else config.moe.dense_layers
    return run_blocks(blocks, x, positions, config, segment_ids, first)


def layer_flags(config: ModelConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The per-layer flags (local, rotate): whether each layer attends through the sliding
    window (`ModelConfig.local_layers`) and whether it rotates queries and keys
    (`ModelConfig.rotary_layers`). Each is None when every layer is alike in it and needs no
    flag: without a local/global pattern, without NoPE layers."""
    local = None if config.attention.global_every is None else np.array(config.local_layers())
    nope = config.positions.kind == "rope" and config.positions.nope_every is not None
    rotate = np.array(config.rotary_layers()) if nope else None
    return local, rotate


def layer_flag(flags: np.ndarray | None, i: int) -> bool | None:
    """Layer i's flag as a Python bool (None for a model without that flag)."""
    return None if flags is None else bool(flags[i])


def _traced(flags: np.ndarray | None):
    return None if flags is None else jnp.asarray(flags)
