"""Qwen3.5-MoE (Qwen Team, 2026): Qwen3.5's hybrid stack (three Gated DeltaNet layers to one
gated attention layer, `eqllm.families.qwen3_5`) with Qwen-MoE's sparse MLP in every layer:
fine-grained SwiGLU experts (top 8 of 256 for the 35B-A3B, probabilities always renormalised)
plus a shared expert scaled by a sigmoid gate.

The experts' only size is `moe_intermediate_size` (config.json has no `intermediate_size`):
eqllm holds it as `mlp.d_ff`. Published checkpoints are vision-language models
(`qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`) with one tensor per expert; eqllm reads
their language model and leaves the vision tower out.
"""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families._moe import (
    MOE_KEYS,
    expert_rows,
    fused_expert_rows,
    has_shared_expert,
    moe_from_hf,
    moe_to_hf,
    shared_expert_rows,
)
from eqllm.families.base import LLAMA_PREFIX, PLAIN_EXPERTS, Family, need
from eqllm.families.qwen3_5 import (
    HYBRID_FIXED,
    HYBRID_KEYS,
    IGNORED,
    PUBLISHED,
    gguf_refuses,
    hybrid_from_hf,
    hybrid_table,
    hybrid_to_hf,
)


def fused_moe(layer: str, stack: str) -> tuple:
    """A stack's router, fused experts and gated shared expert (transformers 5's in memory)."""
    return fused_expert_rows(f"{layer}mlp", stack) + shared_expert_rows(f"{layer}mlp", stack)


def per_expert_moe(layer: str, stack: str) -> tuple:
    """The same with one tensor per expert (Qwen-MoE's published layout)."""
    moe = f"{layer}mlp"
    return expert_rows(moe, "gate_proj", "up_proj", "down_proj", stack) + shared_expert_rows(
        moe, stack
    )


_VL = "model.language_model."
# Published checkpoints and transformers' save_pretrained hold one tensor per expert;
# transformers 5 fuses them in memory (and a checkpoint saved so is read too).
TABLE = hybrid_table(LLAMA_PREFIX, per_expert_moe)
LAYOUTS = (
    hybrid_table(_VL, per_expert_moe),
    hybrid_table(LLAMA_PREFIX, fused_moe),
    hybrid_table(_VL, fused_moe),
)
# Qwen3_5MoeTextConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {"num_experts_per_tok": 8, "router_aux_loss_coef": 0.001}
# Besides Qwen3.5's: transformers always renormalises the top-k probabilities.
_PUBLISHED_MOE = {**PUBLISHED, "norm_topk_prob": True}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **hybrid_to_hf(cfg),
        **moe_to_hf(cfg),
        "num_experts": cfg.moe.n_experts,
        "moe_intermediate_size": cfg.expert_d_ff,
        "shared_expert_intermediate_size": cfg.moe.shared_d_ff,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers' Qwen3_5MoeTextConfig has no intermediate_size: a file's is never read.
    d_ff = need(hf, "moe_intermediate_size")
    return {
        **hybrid_from_hf({**hf, "intermediate_size": d_ff}, _PUBLISHED_MOE),
        **moe_from_hf(hf, _DEFAULTS),
        "moe.n_experts": need(hf, "num_experts"),
        "moe.shared_d_ff": need(hf, "shared_expert_intermediate_size"),
    }


FAMILY = Family(
    name="qwen3_5_moe",
    released="2026-02",
    architecture="Qwen3_5MoeForCausalLM",
    model_type="qwen3_5_moe_text",
    fixed={
        **{k: v for k, v in HYBRID_FIXED.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "moe.d_ff": None,  # the experts' size is mlp.d_ff
        "moe.norm_topk_prob": True,
        "moe.shared_gated": True,
    },
    table=TABLE,
    layouts=LAYOUTS,
    prefix=LLAMA_PREFIX,
    hf_keys=HYBRID_KEYS
    | MOE_KEYS
    | set(_PUBLISHED_MOE)
    | {"num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"},
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_shared_expert,
    gguf="qwen35moe",
    gguf_refuses=gguf_refuses,
    wrapper="qwen3_5_moe",
    ignored=IGNORED,
)
