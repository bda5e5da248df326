"""Llama 1/2/3 (Touvron et al., 2023; Llama 3 herd, 2024): pre-norm RMSNorm, SwiGLU, rotary
positions with the Llama 3 frequency scaling, grouped-query attention, optional biases."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    Family,
    attention_bias_from_hf,
    llama_from_hf,
    llama_to_hf,
    one_attention_bias,
    refuse,
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "mlp_bias": cfg.mlp.bias,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "rope_interleaved", (False,))  # GPT-J style rotary pairs: not the Llama layout
    return {
        **llama_from_hf(hf),
        **attention_bias_from_hf(hf),
        "mlp.bias": bool(hf.get("mlp_bias", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """eqllm writes Llama's projections without biases: transformers' GGUF reader drops an
    attention bias (`attention_bias`), so a file with one could not be checked against it."""
    return {"attention.out_bias": True} if cfg.attention.out_bias else {}


FAMILY = Family(
    name="llama",
    released="2023-02",
    architecture="LlamaForCausalLM",
    model_type="llama",
    fixed={
        **LLAMA_BLOCK,
        "attention.sliding_window": None,
    },
    table=LLAMA_TABLE,
    prefix=LLAMA_PREFIX,
    # is_llama_config: nanotron's marker in exported configs (SmolLM2); transformers ignores it.
    hf_keys=LLAMA_KEYS
    | {"attention_bias", "mlp_bias", "pretraining_tp", "is_llama_config", "rope_interleaved"},
    to_hf=to_hf,
    from_hf=from_hf,
    check=one_attention_bias,
    gguf="llama",
    gguf_refuses=gguf_refuses,
)
