"""Qwen3-Next (Qwen Team, 2025): the hybrid stack Qwen3.5 later kept (three Gated DeltaNet layers
to one gated attention layer, a quarter of each head rotated, (1 + w) norms;
`eqllm.families.qwen3_5`) with a sparse MLP of fine-grained SwiGLU experts (top 10 of 512 for the
80B-A3B) plus a sigmoid-gated shared expert in every layer.

Its Gated DeltaNet stores its input projections fused and grouped by key head: `in_proj_qkvz`
holds, for each key head, its query and key rows and then the value and gate (z) rows of the
value heads that share it; `in_proj_ba` the same for b and a. transformers would give layers
a dense MLP by `decoder_sparse_step` and `mlp_only_layers`; the published files put experts in
every layer, the only stack eqllm reads.
"""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families._moe import (
    MOE_KEYS,
    QWEN_EXPERT_KEYS,
    has_shared_expert,
    moe_from_hf,
    moe_to_hf,
    qwen_experts_to_hf,
    sparse_everywhere,
)
from eqllm.families.base import LLAMA_PREFIX, PLAIN_EXPERTS, Family, need, rows
from eqllm.families.qwen3_5 import (
    HYBRID_FIXED,
    HYBRID_KEYS,
    hybrid_from_hf,
    hybrid_table,
    hybrid_to_hf,
)
from eqllm.families.qwen3_5 import gguf_refuses as hybrid_gguf_refuses
from eqllm.families.qwen3_5_moe import fused_moe, per_expert_moe


def grouped_projections(gdn: str) -> tuple:
    """Qwen3-Next's Gated DeltaNet input projections, their rows grouped by key head:
    [q, k, v, z] of key head 0 (its value heads' v and z), then of key head 1, ...; [b, a]
    likewise."""
    ours = "linear_blocks.attn."
    return rows(
        (f"{gdn}in_proj_qkvz.weight", tuple(f"{ours}{p}_proj.weight" for p in "qkvz")),
        (f"{gdn}in_proj_ba.weight", (f"{ours}b_proj.weight", f"{ours}a_proj.weight")),
        per_head=True,
        heads="linear.n_key_heads",
    )


# Published checkpoints and transformers' save_pretrained hold one tensor per expert;
# transformers 5 fuses them in memory.
TABLE = hybrid_table(LLAMA_PREFIX, per_expert_moe, grouped_projections)
FUSED = hybrid_table(LLAMA_PREFIX, fused_moe, grouped_projections)
# Qwen3NextConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {"num_experts_per_tok": 10, "router_aux_loss_coef": 0.001}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **hybrid_to_hf(cfg),
        **moe_to_hf(cfg),
        "intermediate_size": cfg.mlp.d_ff,
        **qwen_experts_to_hf(cfg),
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    sparse_everywhere(hf, "Qwen3-Next")
    return {
        **hybrid_from_hf(hf, {}),
        **moe_from_hf(hf, _DEFAULTS),
        "moe.n_experts": need(hf, "num_experts"),
        "moe.d_ff": need(hf, "moe_intermediate_size"),
        "moe.shared_d_ff": need(hf, "shared_expert_intermediate_size"),
        "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's Qwen3-Next always renormalises the chosen experts' weights (and sizes value
    heads as key heads, `qwen3_5.gguf_refuses`)."""
    wrong = hybrid_gguf_refuses(cfg)
    return wrong if cfg.moe.norm_topk_prob else {**wrong, "moe.norm_topk_prob": False}


FAMILY = Family(
    name="qwen3_next",
    released="2025-09",
    architecture="Qwen3NextForCausalLM",
    model_type="qwen3_next",
    fixed={
        **{k: v for k, v in HYBRID_FIXED.items() if k != "moe"},
        **PLAIN_EXPERTS,
        "moe.shared_gated": True,
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=HYBRID_KEYS | MOE_KEYS | QWEN_EXPERT_KEYS,
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_shared_expert,
    gguf="qwen3next",
    gguf_refuses=gguf_refuses,
    ignored=r"^mtp\.",  # the published multi-token-prediction layer
)
