"""Mistral (Jiang et al., 2023): the Llama block with sliding-window attention."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    Family,
    llama_from_hf,
    llama_to_hf,
    refuse,
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "sliding_window": cfg.attention.sliding_window,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    return {
        **llama_from_hf(hf),
        "attention.sliding_window": hf.get("sliding_window"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's "llama" architecture has no sliding window: only a Mistral without one (every
    position attending to all before it) is the same model written as Llama."""
    window = cfg.attention.sliding_window
    return {} if window is None else {"attention.sliding_window": window}


FAMILY = Family(
    name="mistral",
    released="2023-09",
    architecture="MistralForCausalLM",
    model_type="mistral",
    fixed={
        **LLAMA_BLOCK,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "mlp.bias": False,
        "positions.scaling": None,
    },
    table=LLAMA_TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS | {"sliding_window"},
    to_hf=to_hf,
    from_hf=from_hf,
    gguf="llama",
    gguf_refuses=gguf_refuses,
)
