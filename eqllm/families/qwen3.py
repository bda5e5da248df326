"""Qwen3 (Qwen Team, 2025): the Llama block with QK-norm (RMSNorm over each query and key head
before the rotation), a head size decoupled from d_model, no q/k/v biases; the small sizes tie
the LM head to the embedding."""

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
    full_attention_only,
    llama_from_hf,
    llama_to_hf,
    one_attention_bias,
    refuse,
)

TABLE = LLAMA_TABLE + QK_NORM_ROWS


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "use_sliding_window", (False, None))
    full_attention_only(hf, "Qwen3")
    return {
        **llama_from_hf(hf),
        **attention_bias_from_hf(hf),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="qwen3",
    released="2025-04",
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    fixed={
        **LLAMA_BLOCK,
        "mlp.bias": False,
        "attention.sliding_window": None,
        "attention.qk_norm": "head",
    },
    table=TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=one_attention_bias,
    gguf="qwen3",
)
