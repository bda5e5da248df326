"""Gemma 2 (Gemma Team, 2024, "Gemma 2: Improving Open Language Models at a Practical Size"):
Gemma's block with a norm before and after both attention and MLP, local (sliding-window) and
global layers alternating, soft-capped attention scores and final logits, and attention scores
scaled by query_pre_attn_scalar**-0.5."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    DENSE,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    Family,
    global_every,
    layer_types,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
    rows,
)
from eqllm.families.gemma import GEMMA_FIXED

# Gemma 2 names its four norms by position; `post_attention_layernorm` is the norm after
# attention here, not the one before the MLP as in Llama.
SANDWICH_TABLE = tuple(
    r for r in LLAMA_TABLE if r.hf != "model.layers.{i}.post_attention_layernorm.weight"
) + rows(
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.attn_post_norm.weight"),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blocks.mlp_norm.weight"),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blocks.mlp_post_norm.weight"),
)
GELU_TANH = ("gelu_pytorch_tanh", "gelu")  # "gelu" is the releases' legacy name for the same
# Keys of the Gemma 2/3 configs beyond the Llama ones (cache_implementation is generation-only;
# the first Gemma 2 releases repeat sliding_window as sliding_window_size).
SANDWICH_KEYS = LLAMA_KEYS | {
    "hidden_activation",
    "attention_bias",
    "use_bidirectional_attention",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "cache_implementation",
    "sliding_window_size",
}


def sandwich_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields Gemma 2 and 3 share."""
    return {
        **llama_to_hf(cfg),
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": cfg.attention.query_pre_attn_scalar,
        "sliding_window": cfg.attention.sliding_window,
        "layer_types": layer_types(cfg),
        "final_logit_softcapping": cfg.final_softcap,
        "attn_logit_softcapping": cfg.attention.softcap,
    }


def sandwich_from_hf(hf: dict[str, Any], default_every: int) -> dict[str, Any]:
    """ModelConfig fields Gemma 2 and 3 read alike (RoPE aside)."""
    refuse(hf, "hidden_act", GELU_TANH)
    refuse(hf, "hidden_activation", (*GELU_TANH, None))
    refuse(hf, "attention_bias", (False,))
    refuse(hf, "use_bidirectional_attention", (False, None))
    refuse(hf, "tie_word_embeddings", (True,))
    fields = llama_from_hf(hf)
    refuse(hf, "sliding_window_size", (hf.get("sliding_window"), None))
    return {
        **fields,
        "attention.query_pre_attn_scalar": hf.get("query_pre_attn_scalar")
        or fields["attention.head_dim"],
        "attention.sliding_window": need(hf, "sliding_window"),
        "attention.global_every": global_every(hf, default_every),
        "final_softcap": hf.get("final_logit_softcapping"),
    }


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return sandwich_to_hf(cfg)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**sandwich_from_hf(hf, 2), "attention.softcap": hf.get("attn_logit_softcapping")}


SANDWICH_FIXED = {
    **DENSE,
    "positions.fraction": 1.0,
    "positions.nope_every": None,
    **GEMMA_FIXED,
    "norms.pre": True,
    "norms.post": True,
    "attention.sinks": False,
}

FAMILY = Family(
    name="gemma2",
    released="2024-06",
    architecture="Gemma2ForCausalLM",
    model_type="gemma2",
    fixed={**SANDWICH_FIXED, "attention.qk_norm": None, "positions.local_theta": None},
    table=SANDWICH_TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=SANDWICH_KEYS,
    to_hf=to_hf,
    from_hf=from_hf,
    # transformers always scales by query_pre_attn_scalar and alternates windowed layers.
    check=lambda cfg: {
        k: cfg.at(k)
        for k in (
            "attention.query_pre_attn_scalar",
            "attention.global_every",
            "attention.sliding_window",
        )
        if cfg.at(k) is None
    },
)
