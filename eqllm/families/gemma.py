"""Gemma (Gemma Team, 2024): GeGLU, (1 + w) RMSNorm, embeddings scaled by sqrt(d_model),
multi-query attention at 2B, LM head tied to the embedding."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import (
    LLAMA_KEYS,
    LLAMA_PREFIX,
    LLAMA_TABLE,
    PLAIN,
    Family,
    llama_from_hf,
    llama_to_hf,
    refuse,
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # "gelu" is the legacy value of Gemma's releases; transformers maps it to the tanh form.
    refuse(hf, "hidden_act", ("gelu_pytorch_tanh", "gelu"))
    refuse(hf, "hidden_activation", ("gelu_pytorch_tanh", "gelu", None))
    refuse(hf, "attention_bias", (False,))
    refuse(hf, "use_bidirectional_attention", (False, None))
    refuse(hf, "tie_word_embeddings", (True,))
    return llama_from_hf(hf)


# What every Gemma generation fixes: (1 + weight) RMSNorm, GeGLU, RoPE without scaling, no
# biases, the embedding scaled by sqrt(d_model) and tied to the head.
GEMMA_FIXED = {
    "norms.kind": "rmsnorm",
    "norms.plus_one": True,
    "mlp.kind": "geglu",
    "positions.kind": "rope",
    "attention.qkv_bias": False,
    "attention.out_bias": False,
    "mlp.bias": False,
    "embed_scale": True,
    "tie_embeddings": True,
    "positions.scaling": None,
}

FAMILY = Family(
    name="gemma",
    released="2024-02",
    architecture="GemmaForCausalLM",
    model_type="gemma",
    fixed={
        **PLAIN,
        **GEMMA_FIXED,
        "attention.sliding_window": None,
        "attention.qk_norm": None,
    },
    table=LLAMA_TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS | {"hidden_activation", "attention_bias", "use_bidirectional_attention"},
    to_hf=to_hf,
    from_hf=from_hf,
)
