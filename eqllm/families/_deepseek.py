"""What DeepSeek-V2 and DeepSeek-V3 share: multi-head latent attention's tensors and config
keys, the dense prefix (`first_k_dense_replace`) and the routed plus always-on shared experts.

A checkpoint's layers 0 .. first_k_dense_replace - 1 have a dense MLP (`dense_blocks` here),
the rest the mixture (`blocks`); the key table names both stacks with the same `{i}` templates
and the hub numbers each stack's layers from its first (`eqllm.hub.tables.stack_layers`).
"""

from __future__ import annotations

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.experts import PLAIN_ROUTER
from eqllm.families._moe import (
    expert_rows,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    PLAIN_EXPERTS,
    Row,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
    rows,
)

_L = "model.layers.{i}"
_ATTENTION = rows(
    (f"{_L}.input_layernorm.weight", "blocks.attn_norm.weight"),
    (f"{_L}.self_attn.q_proj.weight", "blocks.attn.q_proj.weight"),
    (f"{_L}.self_attn.q_a_proj.weight", "blocks.attn.q_a_proj.weight"),
    (f"{_L}.self_attn.q_a_proj.bias", "blocks.attn.q_a_proj.bias"),
    (f"{_L}.self_attn.q_a_layernorm.weight", "blocks.attn.q_a_norm.weight"),
    (f"{_L}.self_attn.q_b_proj.weight", "blocks.attn.q_b_proj.weight"),
    (f"{_L}.self_attn.kv_a_proj_with_mqa.weight", "blocks.attn.kv_a_proj.weight"),
    (f"{_L}.self_attn.kv_a_proj_with_mqa.bias", "blocks.attn.kv_a_proj.bias"),
    (f"{_L}.self_attn.kv_a_layernorm.weight", "blocks.attn.kv_a_norm.weight"),
    (f"{_L}.self_attn.kv_b_proj.weight", "blocks.attn.kv_b_proj.weight"),
    (f"{_L}.self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
    (f"{_L}.self_attn.o_proj.bias", "blocks.attn.o_proj.bias"),
    (f"{_L}.post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
)
DENSE_MLP_ROWS = rows(
    (f"{_L}.mlp.gate_proj.weight", "blocks.mlp.gate.weight"),
    (f"{_L}.mlp.up_proj.weight", "blocks.mlp.up.weight"),
    (f"{_L}.mlp.down_proj.weight", "blocks.mlp.down.weight"),
)
SHARED_ROWS = rows(
    (f"{_L}.mlp.shared_experts.gate_proj.weight", "blocks.mlp.shared.gate.weight"),
    (f"{_L}.mlp.shared_experts.up_proj.weight", "blocks.mlp.shared.up.weight"),
    (f"{_L}.mlp.shared_experts.down_proj.weight", "blocks.mlp.shared.down.weight"),
    (f"{_L}.mlp.gate.e_score_correction_bias", "blocks.mlp.score_bias"),
)
_OUTSIDE = rows(
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)


def dense_rows(table: tuple[Row, ...]) -> tuple[Row, ...]:
    """The same rows filling the dense prefix's stack (DeepSeek's and GLM-4.5's
    `first_k_dense_replace` layers)."""
    swap = lambda p: "dense_blocks." + p.removeprefix("blocks.")  # noqa: E731
    return tuple(Row(r.hf, tuple(map(swap, r.eqllm)), axis=r.axis) for r in table)


# One tensor per expert, as the published checkpoints and transformers' save_pretrained store them.
TABLE = (
    _OUTSIDE
    + _ATTENTION
    + dense_rows(_ATTENTION + DENSE_MLP_ROWS)
    + expert_rows(f"{_L}.mlp", "gate_proj", "up_proj", "down_proj")
    + SHARED_ROWS
)

KEYS = LLAMA_KEYS | {
    "attention_bias",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "topk_method",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_nextn_predict_layers",
    "scoring_func",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "pretraining_tp",
    "auto_map",
    "quantization_config",
    "mlp_bias",
    "output_router_logits",
    "router_aux_loss_coef",
    # transformers' derived qk_nope_head_dim + qk_rope_head_dim, checked in mla_from_hf.
    "qk_head_dim",
}

# The settings both fix: latent attention, SwiGLU experts with ungated shared experts.
FIXED = {
    **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("moe", "attention.rope_interleave")},
    **{k: v for k, v in PLAIN_EXPERTS.items() if k in ("moe.bias", "moe.activation")},
    "attention.kind": "mla",
    "attention.global_every": None,
    "moe.shared_gated": False,
    "moe.bias": False,
    "moe.score_input": False,
    **PLAIN_ROUTER,
    "moe.sparse_every": 1,
}


def mla_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama-layout sizes, latent attention and the dense prefix's MLP from config.json."""
    refuse(hf, "mlp_bias", (False,))
    n_heads = need(hf, "num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or n_heads
    if kv_heads != n_heads:
        raise ConfigError(
            f"config.json num_key_value_heads={kv_heads} differs from num_attention_heads="
            f"{n_heads}; latent attention expands its keys and values for every head"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(
            f"config.json moe_layer_freq={hf['moe_layer_freq']} is not supported; eqllm's "
            "DeepSeek has experts in every layer after the dense prefix (moe_layer_freq=1)"
        )
    method = (hf.get("quantization_config") or {}).get("quant_method", "fp8")
    if method != "fp8":  # fp8 describes how the published weights are stored, not the model
        raise ConfigError(
            f"config.json quantization_config.quant_method={method!r} is not supported; "
            "eqllm's DeepSeek reads bf16/fp32 weights (cast DeepSeek's fp8 release with its "
            "fp8_cast_bf16.py)"
        )
    nope, rope = need(hf, "qk_nope_head_dim"), need(hf, "qk_rope_head_dim")
    if hf.get("qk_head_dim", nope + rope) != nope + rope:
        raise ConfigError(
            f"config.json qk_head_dim={hf['qk_head_dim']} is not qk_nope_head_dim + "
            f"qk_rope_head_dim = {nope + rope}"
        )
    bias = bool(hf.get("attention_bias", False))
    return {
        **llama_from_hf({k: v for k, v in hf.items() if k != "head_dim"}),
        "attention.head_dim": nope + rope,
        "attention.n_kv_heads": n_heads,
        "attention.kind": "mla",
        "attention.q_lora_rank": hf.get("q_lora_rank"),
        "attention.kv_lora_rank": need(hf, "kv_lora_rank"),
        "attention.qk_nope_head_dim": nope,
        "attention.qk_rope_head_dim": rope,
        "attention.v_head_dim": need(hf, "v_head_dim"),
        "attention.qkv_bias": bias,
        "attention.out_bias": bias,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Routed and shared experts and the dense prefix."""
    d_ff = need(hf, "moe_intermediate_size")
    shared = hf.get("n_shared_experts") or 0
    return {
        "moe.n_experts": need(hf, "n_routed_experts"),
        "moe.experts_per_token": need(hf, "num_experts_per_tok"),
        "moe.d_ff": d_ff,
        "moe.shared_d_ff": shared * d_ff if shared else None,
        "moe.routed_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "moe.dense_layers": int(hf.get("first_k_dense_replace") or 0),
    }


def mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's latent attention, experts and prefix (`head_dim` is transformers' own:
    qk_rope_head_dim)."""
    a, moe = cfg.attention, cfg.moe
    out = {k: v for k, v in llama_to_hf(cfg).items() if k != "head_dim"}
    shared = (moe.shared_d_ff or 0) // cfg.expert_d_ff
    if shared * cfg.expert_d_ff != (moe.shared_d_ff or 0):
        raise ConfigError(
            f"ModelConfig.moe.shared_d_ff={moe.shared_d_ff} is not a whole number of experts of "
            f"d_ff={cfg.expert_d_ff}; DeepSeek's config.json counts shared experts"
        )
    return {
        **out,
        "hidden_act": "silu",
        "attention_bias": a.qkv_bias,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "n_routed_experts": moe.n_experts,
        "n_shared_experts": shared or None,
        "moe_intermediate_size": cfg.expert_d_ff,
        "num_experts_per_tok": moe.experts_per_token,
        "routed_scaling_factor": moe.routed_scale,
        "first_k_dense_replace": moe.dense_layers,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
    }


PREFIX = LLAMA_PREFIX


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """What llama.cpp's deepseek2 cannot hold: attention biases (it has none), rotary dims
    rotated as halves (it turns adjacent pairs: `rope_interleave`), no shared expert (it always
    builds one), groups scored otherwise than by their two best experts (DeepSeek-V2's "max"),
    and YaRN other than DeepSeek's (its file keeps only 0.1 x mscale_all_dim, so mscale must
    equal it) or another scaling."""
    a, moe, s = cfg.attention, cfg.moe, cfg.positions.scaling
    wrong: dict[str, Any] = {}
    if a.qkv_bias or a.out_bias:
        wrong["attention.qkv_bias"] = a.qkv_bias
    if not a.rope_interleave:
        wrong["attention.rope_interleave"] = False
    if not moe.shared_d_ff:
        wrong["moe.shared_d_ff"] = moe.shared_d_ff
    if moe.n_groups is not None and moe.group_score != "top2_sum":
        wrong["moe.group_score"] = moe.group_score
    if s is not None and s.kind != "yarn":
        wrong["positions.scaling.kind"] = s.kind
    elif s is not None:
        if s.mscale != s.mscale_all_dim:
            wrong["positions.scaling.mscale"] = s.mscale
        for name in ("attention_factor", "truncate"):
            if getattr(s, name) is not None:
                wrong[f"positions.scaling.{name}"] = getattr(s, name)
    return wrong
