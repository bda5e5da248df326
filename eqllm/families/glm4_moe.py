"""GLM-4.5 (Zhipu AI / Z.ai, 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation
Models"; GLM-4.5-Air and GLM-4.6 share it): grouped-query attention with biases on q/k/v (not on
the output), rotary positions on the leading half of each head (`partial_rotary_factor`,
rotate-half layout), an optional QK-norm over each head before the rotation (`use_qk_norm`),
the first `first_k_dense_replace` layers dense and the rest DeepSeek-V3's mixture: sigmoid
router scores plus the correction bias `e_score_correction_bias` to choose (not to weigh), the
best `topk_group` of `n_group` groups (a single group in the releases), the chosen scores
renormalised and multiplied by `routed_scaling_factor`, and `n_shared_experts` ungated shared
experts of `moe_intermediate_size` each.

Published checkpoints add `num_nextn_predict_layers` multi-token-prediction layers after the
last one (model.layers.92 in GLM-4.5, model.layers.46 in GLM-4.5-Air); import skips them, as
transformers does.
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.experts import PLAIN_ROUTER
from eqllm.families._deepseek import DENSE_MLP_ROWS, SHARED_ROWS, dense_rows
from eqllm.families._moe import (
    FUSED_EXPERT_ROWS,
    MOE_ATTENTION_TABLE,
    expert_rows,
    has_experts,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    QK_NORM_ROWS,
    Family,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
)

_ATTENTION = MOE_ATTENTION_TABLE + QK_NORM_ROWS
_LAYER_ROWS = tuple(r for r in _ATTENTION if r.layered)
# The dense prefix (attention and a dense MLP), then the mixture's stack: one tensor per expert,
# as the published checkpoints and transformers' save_pretrained store them.
_DENSE = dense_rows(_LAYER_ROWS + DENSE_MLP_ROWS)
TABLE = (
    _ATTENTION
    + _DENSE
    + expert_rows("model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj")
    + SHARED_ROWS
)
# transformers' in-memory layout: the routed experts fused.
FUSED = _ATTENTION + _DENSE + FUSED_EXPERT_ROWS + SHARED_ROWS
# Glm4MoeConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {
    "partial_rotary_factor": 0.5,
    "attention_bias": False,
    "use_qk_norm": False,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
}


def _shared_experts(cfg: ModelConfig) -> int:
    """config.json's n_shared_experts: the shared expert's width in routed experts."""
    moe = cfg.moe
    shared = (moe.shared_d_ff or 0) // cfg.expert_d_ff
    if shared < 1 or shared * cfg.expert_d_ff != moe.shared_d_ff:
        raise ConfigError(
            f"ModelConfig.moe.shared_d_ff={moe.shared_d_ff} is not a whole, non-zero number of "
            f"experts of d_ff={cfg.expert_d_ff}; GLM-4.5's config.json counts shared experts"
        )
    return shared


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "partial_rotary_factor": cfg.positions.fraction,
        "use_qk_norm": cfg.attention.qk_norm == "head",
        "n_routed_experts": moe.n_experts,
        "n_shared_experts": _shared_experts(cfg),
        "moe_intermediate_size": cfg.expert_d_ff,
        "num_experts_per_tok": moe.experts_per_token,
        "routed_scaling_factor": moe.routed_scale,
        "n_group": moe.n_groups or 1,
        "topk_group": moe.topk_groups or 1,
        "first_k_dense_replace": moe.dense_layers,
        "norm_topk_prob": moe.norm_topk_prob,
        "num_nextn_predict_layers": 0,  # eqllm writes no multi-token-prediction layers
    }


def _groups(hf: dict[str, Any]) -> dict[str, Any]:
    """n_group / topk_group: one group (the releases') is no grouping at all."""
    groups, best = hf["n_group"] or 1, hf["topk_group"] or 1
    if groups == 1:
        if best != 1:
            raise ConfigError(f"config.json topk_group={best} exceeds n_group=1")
        return {"moe.n_groups": None, "moe.topk_groups": None}
    return {"moe.n_groups": groups, "moe.topk_groups": best}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "scoring_func", ("sigmoid",))  # remote-code names of what transformers does
    refuse(hf, "topk_method", ("noaux_tc",))
    hf = {**_DEFAULTS, **hf}
    # transformers 5 repeats partial_rotary_factor inside rope_parameters.
    rope = dict(hf.get("rope_parameters") or {})
    fraction = rope.pop("partial_rotary_factor", hf["partial_rotary_factor"])
    shared = hf["n_shared_experts"]
    if not shared:
        raise ConfigError(
            f"config.json n_shared_experts={shared!r} is not supported; eqllm's GLM-4.5 has at "
            "least one shared expert (transformers' Glm4MoeMoE always builds one)"
        )
    d_ff = need(hf, "moe_intermediate_size")
    bias = bool(hf["attention_bias"])
    return {
        **llama_from_hf({**hf, "rope_parameters": rope}, eps=1e-5),
        **_groups(hf),
        "positions.fraction": float(fraction),
        "attention.qkv_bias": bias,
        "attention.qk_norm": "head" if hf["use_qk_norm"] else None,
        "moe.n_experts": need(hf, "n_routed_experts"),
        "moe.experts_per_token": need(hf, "num_experts_per_tok"),
        "moe.d_ff": d_ff,
        "moe.shared_d_ff": shared * d_ff,
        "moe.routed_scale": float(hf["routed_scaling_factor"]),
        "moe.dense_layers": int(hf["first_k_dense_replace"] or 0),
        "moe.norm_topk_prob": bool(hf["norm_topk_prob"]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


# What the Llama block fixes and config.json sets here.
_READ = ("moe", "positions.fraction", "attention.qk_norm")


def _check(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.moe is None:
        return has_experts(cfg)
    if not cfg.moe.shared_d_ff:
        return {"moe.shared_d_ff": None}
    if cfg.attention.qk_norm == "l2":  # use_qk_norm is a weighted RMSNorm here
        return {"attention.qk_norm": "l2"}
    return {}


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's glm4moe rotates a whole number of dims (`rope.dimension_count`)."""
    rotated = cfg.head_dim * cfg.positions.fraction
    return {"positions.fraction": cfg.positions.fraction} if rotated != int(rotated) else {}


FAMILY = Family(
    name="glm4_moe",
    released="2025-07",
    architecture="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in _READ},
        "attention.out_bias": False,
        "attention.sliding_window": None,
        "mlp.bias": False,
        "moe.bias": False,
        "moe.activation": "swiglu",
        "moe.shared_gated": False,
        "moe.scoring": "sigmoid",
        "moe.score_bias": True,
        "moe.group_score": "top2_sum",
        "moe.score_input": False,
        **PLAIN_ROUTER,
        "moe.sparse_every": 1,
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "partial_rotary_factor",
        "use_qk_norm",
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "norm_topk_prob",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "output_router_logits",
        "scoring_func",
        "topk_method",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=_check,
    defaults=_DEFAULTS,
    skip_extra_layers=True,
    gguf="glm4moe",
    gguf_refuses=gguf_refuses,
)
