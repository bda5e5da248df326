"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): the Mistral block with every MLP replaced
by a sparse mixture of SwiGLU experts, each token routed to the top 2 of 8 with their router
probabilities renormalised."""

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
    Family,
    llama_from_hf,
    llama_to_hf,
    refuse,
)

# Published checkpoints (and transformers' save_pretrained) name the sparse MLP
# `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down); transformers 5 holds it fused.
TABLE = MOE_ATTENTION_TABLE + expert_rows("model.layers.{i}.block_sparse_moe", "w1", "w3", "w2")
FUSED = MOE_ATTENTION_TABLE + FUSED_EXPERT_ROWS
_DEFAULTS = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}  # MixtralConfig's


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "hidden_act": "silu",
        "sliding_window": cfg.attention.sliding_window,
        "num_local_experts": cfg.moe.n_experts,
        "router_jitter_noise": 0.0,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "router_jitter_noise", (0, 0.0, None))
    return {
        **llama_from_hf(hf, eps=1e-5),
        **moe_from_hf(hf, _DEFAULTS),
        "moe.n_experts": hf.get("num_local_experts", 8),
        "attention.sliding_window": hf.get("sliding_window"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="mixtral",
    released="2023-12",
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "moe.d_ff": None,
        "moe.shared_d_ff": None,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "mlp.bias": False,
        "positions.scaling": None,
        "moe.norm_topk_prob": True,
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS | MOE_KEYS | {"sliding_window", "num_local_experts", "router_jitter_noise"},
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_experts,
)
