"""OLMoE (Muennighoff et al., 2024, "OLMoE: Open Mixture-of-Experts Language Models"): the Llama
block with QK-norm over the whole q and k projections (as OLMo 2) and a sparse MLP of 64 small
SwiGLU experts, 8 per token, probabilities not renormalised."""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families._moe import (
    FUSED_EXPERT_ROWS,
    MOE_ATTENTION_TABLE,
    MOE_KEYS,
    expert_rows,
    has_experts,
    moe_from_hf,
    moe_to_hf,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    PLAIN_EXPERTS,
    QK_NORM_ROWS,
    Family,
    attention_bias_from_hf,
    llama_from_hf,
    llama_to_hf,
    one_attention_bias,
    refuse,
    token_ids,
)

_EXPERTS = expert_rows("model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj")
TABLE = MOE_ATTENTION_TABLE + QK_NORM_ROWS + _EXPERTS
FUSED = MOE_ATTENTION_TABLE + QK_NORM_ROWS + FUSED_EXPERT_ROWS
_DEFAULTS = {"num_experts_per_tok": 8, "router_aux_loss_coef": 0.01}  # OlmoeConfig's
_TOKEN_IDS = {"eos_token_id": 50279, "pad_token_id": 1}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **token_ids(cfg, _TOKEN_IDS),
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "clip_qkv": None,
        "num_experts": cfg.moe.n_experts,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "clip_qkv", (None,))
    return {
        **llama_from_hf(hf, eps=1e-5),
        **moe_from_hf(hf, _DEFAULTS),
        **attention_bias_from_hf(hf),
        "moe.n_experts": hf.get("num_experts", 64),
        "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="olmoe",
    released="2024-09",
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "moe.d_ff": None,
        "moe.shared_d_ff": None,
        "mlp.bias": False,
        "attention.sliding_window": None,
        "positions.scaling": None,
        "attention.qk_norm": "whole",
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS | MOE_KEYS | {"attention_bias", "clip_qkv", "num_experts", "norm_topk_prob"},
    to_hf=to_hf,
    from_hf=from_hf,
    # transformers' OLMoE derives the head size from hidden_size / num_attention_heads.
    check=lambda cfg: {
        **has_experts(cfg),
        **(
            {}
            if cfg.head_dim * cfg.attention.n_heads == cfg.d_model
            else {"attention.head_dim": cfg.head_dim}
        ),
        **one_attention_bias(cfg),
    },
)
