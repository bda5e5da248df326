"""DeepSeek-V2 (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model") and V2-Lite: multi-head latent attention (V2-Lite projects
queries directly, `q_lora_rank` null) with its rotary dims rotated as complex pairs, a dense
first layer (`first_k_dense_replace`) and then routed plus shared experts. The router takes a
softmax over all experts and the top k ("greedy"), or first the best `topk_group` of `n_group`
groups, each scored by its best expert ("group_limited_greedy"); the weights are not
renormalised and are multiplied by `routed_scaling_factor`.
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
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
    has_experts,
)
from eqllm.families.base import (
    Family,
    refuse,
)

_METHODS = ("greedy", "group_limited_greedy")


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    grouped = cfg.moe.n_groups is not None
    return {
        **mla_to_hf(cfg),
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "n_group": cfg.moe.n_groups or 1,
        "topk_group": cfg.moe.topk_groups or 1,
        "norm_topk_prob": False,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "scoring_func", ("softmax",))
    method = hf.get("topk_method", "greedy")
    if method not in _METHODS:
        raise ConfigError(
            f"config.json topk_method={method!r} is not supported; DeepSeek-V2 routes by "
            f"{list(_METHODS)}"
        )
    grouped = method == "group_limited_greedy"
    return {
        **mla_from_hf(hf),
        **experts_from_hf(hf),
        "moe.n_groups": hf.get("n_group") if grouped else None,
        "moe.topk_groups": hf.get("topk_group") if grouped else None,
    }


FAMILY = Family(
    name="deepseek_v2",
    released="2024-05",
    architecture="DeepseekV2ForCausalLM",
    model_type="deepseek_v2",
    fixed={
        **FIXED,
        # V2 rotates interleaved pairs (complex multiplication) and does not renormalise.
        "attention.rope_interleave": True,
        "moe.norm_topk_prob": False,
        "moe.scoring": "softmax",
        "moe.score_bias": False,
        "moe.group_score": "max",
    },
    table=TABLE,
    prefix=PREFIX,
    hf_keys=KEYS,
    to_hf=to_hf,
    from_hf=from_hf,
    check=has_experts,
    skip_extra_layers=True,
    gguf="deepseek2",
    gguf_refuses=gguf_refuses,
)
