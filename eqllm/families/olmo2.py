"""OLMo 2 (Team OLMo, 2024, "2 OLMo 2 Furious"): the Llama block with its norms moved onto the
sublayers' outputs (RMSNorm after attention and after the MLP, before each residual add, none
before them) and QK-norm over the whole q and k projections rather than per head."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    QK_NORM_ROWS,
    Family,
    attention_bias_from_hf,
    llama_from_hf,
    llama_to_hf,
    one_attention_bias,
    refuse,
    rows,
    token_ids,
)

# OLMo 2's `post_attention_layernorm` normalises the attention output (Llama's normalises the
# MLP input), and there is no input_layernorm: the model has no pre-norm arrays to match it.
TABLE = (
    tuple(r for r in LLAMA_TABLE if r.hf != "model.layers.{i}.post_attention_layernorm.weight")
    + rows(
        ("model.layers.{i}.post_attention_layernorm.weight", "blocks.attn_post_norm.weight"),
        ("model.layers.{i}.post_feedforward_layernorm.weight", "blocks.mlp_post_norm.weight"),
    )
    + QK_NORM_ROWS
)


_TOKEN_IDS = {"eos_token_id": 50279, "pad_token_id": 1}  # Olmo2Config's


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **token_ids(cfg, _TOKEN_IDS),
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    return {
        **llama_from_hf(hf, eps=1e-5),
        **attention_bias_from_hf(hf),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's olmo2 needs its own output head (`output.weight`) and reads no attention
    biases."""
    tied = {"tie_embeddings": True} if cfg.tie_embeddings else {}
    return {**tied, **({"attention.qkv_bias": True} if cfg.attention.qkv_bias else {})}


FAMILY = Family(
    name="olmo2",
    released="2024-11",
    architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    fixed={
        **LLAMA_BLOCK,
        "mlp.bias": False,
        "attention.sliding_window": None,
        "attention.qk_norm": "whole",
        "norms.pre": False,
        "norms.post": True,
    },
    table=TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS | {"attention_bias"},
    to_hf=to_hf,
    from_hf=from_hf,
    # transformers' Olmo2 derives the head size from hidden_size / num_attention_heads, and one
    # `attention_bias` switch sets the q/k/v and the output biases.
    check=lambda cfg: {
        **(
            {}
            if cfg.head_dim * cfg.attention.n_heads == cfg.d_model
            else {"attention.head_dim": cfg.head_dim}
        ),
        **one_attention_bias(cfg),
    },
    gguf="olmo2",
    gguf_refuses=gguf_refuses,
)
