"""gpt-oss (OpenAI, 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): a mixture of experts whose
layers alternate a 128-token sliding window (layer 0) and full attention, with biases on q/k/v/o,
an attention sink per head (a learned logit in the softmax denominator), YaRN-scaled RoPE and, in
every layer, a router with a bias choosing the top 4 experts (softmax over their logits, which
equals the renormalised top 4 of the softmax over all) whose projections have biases and whose
activation is the clamped SwiGLU (`eqllm.nn.moe.clamped_swiglu`).

transformers stores the experts fused as x @ W: `mlp.experts.gate_up_proj` [experts, d_model,
2 d_ff] with the gate and up columns interleaved (gate 0, up 0, gate 1, ...) and its bias
[experts, 2 d_ff], `down_proj` [experts, d_ff, d_model] and its bias [experts, d_model].

The published checkpoints hold the experts MXFP4-quantized (`*_blocks` / `*_scales`,
`quantization_config.quant_method = "mxfp4"`): import dequantizes them as transformers does
(`eqllm.hub.mxfp4`), so the quantization_config describes storage, not the architecture. Export
writes the unquantized layout (no quantization_config).
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.experts import PLAIN_ROUTER
from eqllm.families._moe import (
    MOE_ATTENTION_TABLE,
    MOE_KEYS,
    has_experts,
    moe_from_hf,
    moe_to_hf,
)
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    Family,
    attention_bias_from_hf,
    llama_from_hf,
    llama_to_hf,
    need,
    one_attention_bias,
    refuse,
    rows,
)

_LAYER = "model.layers.{i}"
TABLE = (
    MOE_ATTENTION_TABLE
    + rows(
        (f"{_LAYER}.self_attn.sinks", "blocks.attn.sinks"),
        (f"{_LAYER}.mlp.router.weight", "blocks.mlp.router.weight"),
        (f"{_LAYER}.mlp.router.bias", "blocks.mlp.router.bias"),
        (f"{_LAYER}.mlp.experts.down_proj_bias", "blocks.mlp.down.bias"),
    )
    + rows((f"{_LAYER}.mlp.experts.down_proj", "blocks.mlp.down.weight"), transposed=True)
    + rows(
        (f"{_LAYER}.mlp.experts.gate_up_proj", ("blocks.mlp.gate.weight", "blocks.mlp.up.weight")),
        axis=1,
        interleaved=True,
        transposed=True,
    )
    + rows(
        (
            f"{_LAYER}.mlp.experts.gate_up_proj_bias",
            ("blocks.mlp.gate.bias", "blocks.mlp.up.bias"),
        ),
        axis=1,
        interleaved=True,
    )
)
# GptOssConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.001,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
_QUANTIZATION = ("mxfp4",)  # how published checkpoints store the experts (eqllm.hub.mxfp4)
_PERIOD = 2  # sliding, full, sliding, full, ...


def _layer_types(n_layers: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % _PERIOD else "full_attention" for i in range(n_layers)]


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "intermediate_size": cfg.expert_d_ff,
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "sliding_window": cfg.attention.sliding_window,
        "layer_types": _layer_types(cfg.n_layers),
        "num_local_experts": cfg.moe.n_experts,
        "swiglu_alpha": cfg.moe.swiglu_alpha,
        "swiglu_limit": cfg.moe.swiglu_limit,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    n_layers = need(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is not None and list(types) != _layer_types(n_layers):
        raise ConfigError(
            f"config.json layer_types={types} is not gpt-oss's alternation of sliding and full "
            f"attention starting with a sliding layer, the only pattern eqllm's gpt-oss reads"
        )
    quantization = hf.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") not in _QUANTIZATION:
        raise ConfigError(
            f"config.json quantization_config.quant_method="
            f"{quantization.get('quant_method')!r} is not supported; eqllm's gpt-oss reads "
            "unquantized weights or the published files' 'mxfp4' experts"
        )
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    per_token = hf.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])
    if hf.get("experts_per_token", per_token) != per_token:  # OpenAI's own name, also published
        raise ConfigError(
            f"config.json experts_per_token={hf['experts_per_token']} differs from "
            f"num_experts_per_tok={per_token}"
        )
    return {
        **llama_from_hf(hf, eps=1e-5),
        **moe_from_hf(hf, _DEFAULTS),
        **attention_bias_from_hf(hf),
        "attention.sliding_window": need(hf, "sliding_window"),
        "moe.n_experts": experts if experts is not None else need(hf, "num_local_experts"),
        "moe.swiglu_alpha": float(hf["swiglu_alpha"]),
        "moe.swiglu_limit": float(hf["swiglu_limit"]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="gpt_oss",
    released="2025-08",
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("moe", "attention.sinks")},
        "attention.global_every": _PERIOD,
        "attention.sinks": True,
        "mlp.bias": False,
        "moe.d_ff": None,
        "moe.shared_d_ff": None,
        "moe.norm_topk_prob": True,
        "moe.bias": True,
        "moe.activation": "clamped_swiglu",
        "moe.score_input": False,
        **PLAIN_ROUTER,
        "moe.sparse_every": 1,
    },
    table=TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | MOE_KEYS
    | {
        "attention_bias",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts",
        "swiglu_alpha",
        "swiglu_limit",
        "quantization_config",
        "experts_per_token",
        # OpenAI's name for YaRN's original context, which transformers does not read (it
        # reads rope_scaling.original_max_position_embeddings).
        "initial_context_length",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=lambda cfg: {**has_experts(cfg), **one_attention_bias(cfg)},
    defaults=_DEFAULTS,
)
