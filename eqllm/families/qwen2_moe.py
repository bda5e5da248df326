"""Qwen1.5-MoE / Qwen2-MoE (Qwen Team, 2024): the Qwen2 block (q/k/v biases) with a sparse MLP of
fine-grained SwiGLU experts (top 4 of 60, probabilities not renormalised) plus a shared expert
that every token passes through, scaled by a sigmoid gate."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._moe import (
    FUSED_EXPERT_ROWS,
    MOE_ATTENTION_TABLE,
    MOE_KEYS,
    QWEN_EXPERT_KEYS,
    expert_rows,
    has_shared_expert,
    moe_from_hf,
    moe_to_hf,
    qwen_experts_to_hf,
    shared_expert_rows,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    PLAIN_EXPERTS,
    Family,
    full_attention_only,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
)

SHARED_ROWS = shared_expert_rows("model.layers.{i}.mlp")
_EXPERTS = expert_rows("model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj")
TABLE = MOE_ATTENTION_TABLE + _EXPERTS + SHARED_ROWS
FUSED = MOE_ATTENTION_TABLE + FUSED_EXPERT_ROWS + SHARED_ROWS
_DEFAULTS = {"num_experts_per_tok": 4, "router_aux_loss_coef": 0.001}  # Qwen2MoeConfig's


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "hidden_act": "silu",
        "qkv_bias": cfg.attention.qkv_bias,
        "use_sliding_window": False,
        "sliding_window": None,
        **qwen_experts_to_hf(cfg),
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "use_sliding_window", (False, None))
    refuse(hf, "decoder_sparse_step", (1,))
    if hf.get("mlp_only_layers"):
        raise ConfigError(
            f"config.json mlp_only_layers={hf['mlp_only_layers']}: eqllm's Qwen2-MoE has experts "
            "in every layer"
        )
    full_attention_only(hf, "Qwen2-MoE")
    return {
        **llama_from_hf(hf),
        **moe_from_hf(hf, _DEFAULTS),
        "moe.n_experts": need(hf, "num_experts"),
        "moe.d_ff": need(hf, "moe_intermediate_size"),
        "moe.shared_d_ff": need(hf, "shared_expert_intermediate_size"),
        "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "attention.qkv_bias": bool(hf.get("qkv_bias", True)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="qwen2_moe",
    released="2024-03",
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "attention.out_bias": False,
        "mlp.bias": False,
        "positions.scaling": None,
        "attention.sliding_window": None,
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | MOE_KEYS
    | {
        "qkv_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
    | QWEN_EXPERT_KEYS,
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_shared_expert,
)
