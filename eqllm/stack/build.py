"""Building the stacked blocks from a ModelConfig: each layer's Block (attention or latent
attention, or a hybrid's Gated DeltaNet or Mamba-2; MLP or experts, or none; norms), and the
model's initial parts with every layer kind stacked on a leading `layers` axis
(`initial_parts`)."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from eqllm.attention_backend import attention_kernel
from eqllm.config import ModelConfig
from eqllm.config.kinds import STACKS, stack_field
from eqllm.config.multipliers import MultipliersConfig
from eqllm.nn import (
    MLP,
    Attention,
    Block,
    Embedding,
    GatedDeltaNet,
    GatedMLP,
    LayerNorm,
    Linear,
    Mamba2,
    MoE,
    MultiHeadLatentAttention,
    PerLayerGate,
    PerLayerInputs,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
)
from eqllm.parametrization import init_weights, scales
from eqllm.stack.experts import make_moe

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def multipliers_of(config: ModelConfig) -> MultipliersConfig:
    """The config's forward multipliers (all 1.0 where it has none)."""
    return config.multipliers or MultipliersConfig()


def dtype_of(name: str):
    """The jax dtype of a ModelConfig dtype name ("bfloat16" -> jnp.bfloat16)."""
    return _DTYPES[name]


def make_norm(config: ModelConfig, dtype) -> RMSNorm | LayerNorm:
    """The config's norm over d_model (every norm of the model but the QK-norm)."""
    norms = config.norms
    if norms.kind == "rmsnorm":
        return RMSNorm(config.d_model, eps=norms.eps, plus_one=norms.plus_one, dtype=dtype)
    return LayerNorm(config.d_model, eps=norms.eps, use_bias=norms.bias, dtype=dtype)


def make_rope(config: ModelConfig, global_layer: bool = False) -> RotaryEmbedding | None:
    """The rotary embedding `config.positions` describes (None without RoPE); `global_layer`:
    that of the global layers' own stack (their head size, proportional RoPE)."""
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
    if global_layer:
        head_dim = config.attention.global_head_dim or config.head_dim
        turning = int((pos.global_fraction or 1.0) * head_dim // 2)  # transformers' rope_angles
        return RotaryEmbedding(head_dim, pos.theta, scaling=scaling, still=head_dim // 2 - turning)
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


def make_attention(
    config: ModelConfig,
    key: PRNGKeyArray,
    dtype,
    global_layer: bool = False,
    kv_shared: bool = False,
):
    """The attention layer of a block: grouped-query or latent (`attention.kind`);
    `global_layer`: a layer of the global layers' own stack (`attention.global_shape`);
    `kv_shared`: one without keys and values of its own (`attention.kv_shared_layers`)."""
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
    if (fixed := multipliers_of(config).attention_scale) is not None:  # Granite's
        scale = fixed
    if s.attention != 1.0:  # muP: scores ~ 1 / head_dim when head_dim grows with width
        scale = (config.head_dim**-0.5 if scale is None else scale) * s.attention
    if (key_m := multipliers_of(config).key) != 1.0:  # q . (m k) = m (q . k): the same scores
        scale = (config.head_dim**-0.5 if scale is None else scale) * key_m
    head_dim, kv_heads = a.head_dim, a.n_kv_heads
    if global_layer:
        head_dim, kv_heads = a.global_head_dim or head_dim, a.global_kv_heads or kv_heads
    return Attention(
        config.d_model,
        a.n_heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        qkv_bias=a.qkv_bias,
        out_bias=a.out_bias,
        qk_norm=a.qk_norm in ("head", "whole"),
        qk_norm_per_head=a.qk_norm != "whole",
        norm_plus_one=norms.plus_one,
        rope=make_rope(config, global_layer),
        sliding_window=None if global_layer else a.sliding_window,
        norm_eps=norms.eps,
        scale=scale,
        softcap=a.softcap,
        sinks=a.sinks,
        output_gate=a.output_gate,
        kernel=attention_kernel(config),
        chunk_size=a.chunk_size,
        qk_l2=a.qk_norm == "l2",
        interleaved=a.rope_interleave,
        temperature=(
            None if a.temperature_floor is None else (a.temperature_floor, a.temperature_scale)
        ),
        v_norm=a.v_norm,
        k_eq_v=global_layer and a.k_eq_v,
        kv_shared=kv_shared,
        key=key,
        dtype=dtype,
    )


def make_linear_attention(config: ModelConfig, key: PRNGKeyArray, dtype) -> GatedDeltaNet | Mamba2:
    """The token mixer of a hybrid stack's linear-attention layers (`config.linear`)."""
    lin, m = config.linear, multipliers_of(config)
    if lin.kind == "mamba2":  # keys and queries are B and C, shared by groups of heads
        return Mamba2(
            config.d_model,
            lin.n_value_heads,
            lin.value_head_dim,
            lin.key_head_dim,
            n_groups=lin.n_key_heads,
            conv_kernel=lin.conv_kernel,
            norm_eps=config.norms.eps,
            chunk_size=lin.chunk_size,
            dt_min=lin.dt_min,
            dt_max=lin.dt_max,
            gate_norm=lin.gate_norm,
            in_multiplier=m.ssm_in,
            multipliers=m.ssm,
            key=key,
            dtype=dtype,
        )
    return GatedDeltaNet(
        config.d_model,
        lin.n_key_heads,
        lin.n_value_heads,
        lin.key_head_dim,
        lin.value_head_dim,
        conv_kernel=lin.conv_kernel,
        norm_eps=config.norms.eps if lin.norm_eps is None else lin.norm_eps,
        chunk_size=lin.chunk_size,
        allow_neg_eigval=lin.allow_neg_eigval,
        key=key,
        dtype=dtype,
    )


def make_block(
    config: ModelConfig,
    key: PRNGKeyArray,
    *,
    dense: bool = False,
    linear: bool = False,
    ffn: bool = False,
    global_layer: bool = False,
    shared: bool = False,
) -> Block:
    """One Transformer block as `config` describes it (`dense`: with the dense MLP even in a
    mixture of experts, a layer of kind "dense" (`ModelConfig.layer_kinds`); `linear`: a Gated
    DeltaNet or Mamba-2 in place of attention, a linear-attention layer of a hybrid stack,
    without an MLP where `linear.mlp` is False; with `linear.parallel`, attention with that
    mixer beside it; `ffn`: the feed-forward layer alone, no token mixer, a layer of kind
    "ffn"; an attention layer has no MLP where `linear.full_mlp` is False; `global_layer`: a
    layer of kind "global", shaped as `attention.global_shape` says; `shared`: a kv-shared
    layer, kind "shared" or "shared_global", with `mlp.kv_shared_d_ff` hidden units)."""
    dtype = dtype_of(config.param_dtype)
    k_attn, k_mlp = jax.random.split(key)
    norms = config.norms
    s, m = scales(config), multipliers_of(config)
    ssm, attn, mixer = None, None, (1.0, 1.0)  # a feed-forward layer alone: no mixer
    if linear:
        attn = make_linear_attention(config, k_attn, dtype)
        mixer = (1.0, m.ssm_out)  # the mixer's input multiplier is its own (ssm_in)
    elif not ffn:
        attn = make_attention(config, k_attn, dtype, global_layer, shared)
        mixer = (m.attention_in, m.attention_out)
        if config.linear is not None and config.linear.parallel:  # Falcon-H1
            ssm = make_linear_attention(config, jax.random.fold_in(key, 2), dtype)
    if linear and not config.linear.mlp:
        mlp = None
    elif attn is not None and config.linear is not None and not config.linear.full_mlp:
        mlp = None  # Nemotron-H's attention layers: attention alone
    elif config.moe is not None and not dense:
        mlp = make_moe(config, k_mlp, dtype)
    elif config.mlp.kind in ("gelu", "relu2"):
        mlp = MLP(
            config.d_model,
            (shared and config.mlp.kv_shared_d_ff) or config.mlp.d_ff,
            use_bias=config.mlp.bias,
            approximate=config.mlp.gelu == "tanh",
            relu2=config.mlp.kind == "relu2",
            key=k_mlp,
            dtype=dtype,
        )
    else:
        activation = "silu" if config.mlp.kind == "swiglu" else "gelu"
        mlp = GatedMLP(
            config.d_model,
            (shared and config.mlp.kv_shared_d_ff) or config.mlp.d_ff,
            activation=activation,
            use_bias=config.mlp.bias,
            multipliers=(m.mlp_gate, m.mlp_down),
            key=k_mlp,
            dtype=dtype,
        )

    def norm(wanted: bool):
        return make_norm(config, dtype) if wanted else None

    pre, post = norms.pre, norms.post
    if linear and config.linear.pre_norm:  # OLMo hybrid: pre-norm DeltaNet, post-norm attention
        pre, post = True, False
    has_mlp = mlp is not None
    branched = isinstance(mlp, MoE) and mlp.shared_norm is not None  # Gemma 4: norms its own
    return Block(
        norm(pre and attn is not None),
        attn,
        norm(pre and has_mlp and not branched),
        mlp,
        norm(post),
        norm(post and has_mlp),
        _residual_scale(s.branch, m.residual),
        config.parallel_residual,
        ssm,
        (*mixer, m.ssm_out),
        jnp.ones((1,), dtype) if norms.layer_scalar else None,  # Gemma 4: 1 until trained
        _per_layer_gate(config, jax.random.fold_in(key, 3), dtype),
    )


def _per_layer_gate(config: ModelConfig, key: PRNGKeyArray, dtype) -> PerLayerGate | None:
    """A block's gate of its per-layer input (`config.per_layer`; None without)."""
    if config.per_layer is None:
        return None
    return PerLayerGate(
        config.d_model, config.per_layer.d, eps=config.norms.eps, key=key, dtype=dtype
    )


def _residual_scale(branch: float, residual: float) -> float:
    """The factor on each sublayer's output before the residual add: CompleteP's branch scale
    times a published model's residual multiplier (Granite's; either alone exactly as given)."""
    return residual if branch == 1.0 else branch if residual == 1.0 else branch * residual


@eqx.filter_jit
def initial_parts(config: ModelConfig, key: PRNGKeyArray) -> dict:
    """The model's layers with their initial weights, built in one compiled call.

    Compiled because building eagerly runs hundreds of tiny ops, each compiled on its own: for a
    small model that is ~10x slower than this one XLA computation.
    """
    dtype = dtype_of(config.param_dtype)
    k_embed, k_pos, k_blocks, k_head, k_init = jax.random.split(key, 5)
    block_keys = jax.random.split(k_blocks, config.n_layers)
    # One stack per kind of layer, each layer built from its own key (`eqllm.config.kinds`).
    kinds = np.array(config.layer_kinds())
    stacks = dict.fromkeys(STACKS.values())
    for kind in STACKS:
        if kind in kinds:
            make = functools.partial(
                make_block,
                config,
                dense=kind == "dense",
                linear=kind == "linear",
                ffn=kind == "ffn",
                global_layer=kind in ("global", "shared_global"),
                shared=kind in ("shared", "shared_global"),
            )
            stacks[stack_field(config, kind)] = eqx.filter_vmap(make)(block_keys[kinds == kind])
    parts = {
        "embed": Embedding(
            config.vocab_size, config.d_model, axes=("vocab", "d_model"), key=k_embed, dtype=dtype
        ),
        "pos_embed": (
            Embedding(
                config.max_seq_len,
                config.d_model,
                axes=("positions", "d_model"),
                key=k_pos,
                dtype=dtype,
            )
            if config.positions.kind == "learned"
            else None
        ),
        **stacks,
        "per_layer": (
            None
            if (p := config.per_layer) is None
            else PerLayerInputs(
                p.vocab_size or config.vocab_size,
                config.d_model,
                config.n_layers,
                p.d,
                eps=config.norms.eps,
                key=jax.random.fold_in(k_embed, 1),
                dtype=dtype,
            )
        ),
        "lm_head": (
            None
            if config.tie_embeddings
            else Linear(
                config.d_model,
                config.vocab_size,
                axes=("vocab", "d_model"),
                key=k_head,
                dtype=dtype,
            )
        ),
    }
    weights = init_weights(parts, k_init, scales=scales(config), init_std=config.init_std)
    return {**weights, "final_norm": make_norm(config, dtype)}
