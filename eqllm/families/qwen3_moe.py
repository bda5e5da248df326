"""Qwen3-MoE (Qwen Team, 2025, "Qwen3 Technical Report"): the Qwen3 block (QK-norm over each
query and key head, 128-wide heads, no biases) with a sparse MLP of fine-grained SwiGLU experts
in every layer (top 8 of 128, probabilities renormalised by `norm_topk_prob`) and no shared
expert."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._moe import (
    FUSED_EXPERT_ROWS,
    MOE_ATTENTION_TABLE,
    MOE_KEYS,
    expert_rows,
    has_experts,
    moe_from_hf,
    moe_to_hf,
    sparse_everywhere,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    PLAIN_EXPERTS,
    QK_NORM_ROWS,
    Family,
    attention_bias_from_hf,
    full_attention_only,
    llama_from_hf,
    llama_to_hf,
    need,
    one_attention_bias,
    refuse,
)

_EXPERTS = expert_rows("model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj")
TABLE = MOE_ATTENTION_TABLE + QK_NORM_ROWS + _EXPERTS
FUSED = MOE_ATTENTION_TABLE + QK_NORM_ROWS + FUSED_EXPERT_ROWS
# Qwen3MoeConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {"num_experts_per_tok": 8, "router_aux_loss_coef": 0.001}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": cfg.moe.n_experts,
        "moe_intermediate_size": cfg.expert_d_ff,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _n_experts(hf: dict[str, Any]) -> int:
    """The expert count: published files spell it `num_experts`, transformers 5 writes
    `num_local_experts` (its attribute map); both, when present, must agree."""
    spellings = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(spellings.values())) > 1:
        raise ConfigError(f"config.json sets the expert count twice, differently: {spellings}")
    if not spellings:
        return need(hf, "num_experts")
    return next(iter(spellings.values()))


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "use_sliding_window", (False, None))
    full_attention_only(hf, "Qwen3-MoE")
    sparse_everywhere(hf, "Qwen3-MoE")
    return {
        **llama_from_hf(hf),
        **moe_from_hf(hf, _DEFAULTS),
        **attention_bias_from_hf(hf),
        "moe.n_experts": _n_experts(hf),
        "moe.d_ff": need(hf, "moe_intermediate_size"),
        "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="qwen3_moe",
    released="2025-04",
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "moe.shared_d_ff": None,
        "mlp.bias": False,
        "attention.sliding_window": None,
        "attention.qk_norm": "head",
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | MOE_KEYS
    | {
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "num_experts",
        "num_local_experts",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=lambda cfg: {**has_experts(cfg), **one_attention_bias(cfg)},
)
