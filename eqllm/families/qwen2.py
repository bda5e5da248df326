"""Qwen2 / Qwen2.5 (Yang et al., 2024): the Llama block with q/k/v biases."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    Family,
    full_attention_only,
    llama_from_hf,
    llama_to_hf,
    refuse,
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "use_sliding_window", (False, None))
    full_attention_only(hf, "Qwen2")
    return {**llama_from_hf(hf), "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}


FAMILY = Family(
    name="qwen2",
    released="2024-06",
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    fixed={
        **LLAMA_BLOCK,
        "attention.qkv_bias": True,
        "attention.out_bias": False,
        "mlp.bias": False,
        "attention.sliding_window": None,
        "positions.scaling": None,
    },
    table=LLAMA_TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    to_hf=to_hf,
    from_hf=from_hf,
    gguf="qwen2",
)
