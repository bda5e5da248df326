"""DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"; Kimi K2 shares it, its
config.json naming model_type "kimi_k2"): multi-head latent attention with a compressed query
(`eqllm.nn.mla`) and rotary dims in interleaved pairs, YaRN with DeepSeek's mscale in the
softmax scale, the first `first_k_dense_replace` layers dense and the rest a mixture of 256
fine-grained routed experts (8 per token) plus one always-on shared expert. The router scores
each expert by a sigmoid, adds the correction bias `e_score_correction_bias` to choose (not to
weigh), keeps each token to the best `topk_group` of `n_group` groups (a group scored by its two
best experts), renormalises the chosen scores and multiplies them by `routed_scaling_factor`.

Published checkpoints add `num_nextn_predict_layers` multi-token-prediction layers after the
last one (model.layers.61 in DeepSeek-V3); import skips them, as transformers does.
"""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families._deepseek import (
    FIXED,
    KEYS,
    PREFIX,
    TABLE,
    experts_from_hf,
    gguf_refuses,
    mla_from_hf,
    mla_to_hf,
)
from eqllm.families._moe import (
    FUSED_EXPERT_ROWS,
    has_experts,
)
from eqllm.families.base import (
    Family,
    refuse,
)

# transformers' in-memory layout: the routed experts fused.
_ROUTED = (".mlp.experts.", ".mlp.gate.weight")
FUSED = tuple(r for r in TABLE if not any(k in r.hf for k in _ROUTED)) + FUSED_EXPERT_ROWS
# DeepseekV3Config's defaults, for keys a config.json leaves out.
_DEFAULTS = {"rope_interleave": True, "norm_topk_prob": True, "n_group": 8, "topk_group": 4}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **mla_to_hf(cfg),
        "rope_interleave": cfg.attention.rope_interleave,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "n_group": cfg.moe.n_groups or 1,
        "topk_group": cfg.moe.topk_groups or 1,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "scoring_func", ("sigmoid",))
    refuse(hf, "topk_method", ("noaux_tc",))
    hf = {**_DEFAULTS, **hf}
    groups = hf["n_group"] or 1
    return {
        **mla_from_hf(hf),
        **experts_from_hf(hf),
        "attention.rope_interleave": bool(hf["rope_interleave"]),
        "moe.norm_topk_prob": bool(hf["norm_topk_prob"]),
        "moe.n_groups": groups,
        "moe.topk_groups": hf["topk_group"] or 1,
    }


FAMILY = Family(
    name="deepseek_v3",
    released="2024-12",
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    fixed={
        **FIXED,
        "moe.scoring": "sigmoid",
        "moe.score_bias": True,
        "moe.group_score": "top2_sum",
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=PREFIX,
    hf_keys=KEYS | {"rope_interleave"},
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_experts,
    defaults=_DEFAULTS,
    skip_extra_layers=True,
    gguf="deepseek2",
    gguf_refuses=gguf_refuses,
    also_reads=("kimi_k2",),
)
