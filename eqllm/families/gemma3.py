"""Gemma 3, text only (Gemma Team, 2025, "Gemma 3 Technical Report"): Gemma 2's block with
QK-norm ((1 + w) RMSNorm over each head) in place of soft-capping, five local (sliding-window)
layers to one global, a RoPE base of its own for the local layers, and (4B and up) linear RoPE
scaling on the global layers only."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._rope import rope_from_hf
from eqllm.families.base import LLAMA_PREFIX, QK_NORM_ROWS, Family
from eqllm.families.gemma2 import (
    SANDWICH_FIXED,
    SANDWICH_KEYS,
    SANDWICH_TABLE,
    sandwich_from_hf,
    sandwich_to_hf,
)

TABLE = SANDWICH_TABLE + QK_NORM_ROWS
_PATTERN = 6  # transformers' default sliding_window_pattern


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # The older layout, which transformers 5 converts into per-layer-type rope_parameters: its
    # rope_scaling (linear, or none) is the global layers', the local ones keep plain RoPE.
    return {
        **sandwich_to_hf(cfg),
        "rope_local_base_freq": cfg.positions.local_theta,
        "sliding_window_pattern": cfg.attention.global_every,
    }


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The global RoPE base and scaling (linear or none) and the local base, from either
    config.json layout; the local layers' RoPE must be plain."""
    params = hf.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict(params.get("full_attention") or {}) if nested else dict(params)
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    rope_type = local.get("rope_type", local.get("type", "default"))
    if rope_type != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
        raise ConfigError(
            f"config.json rope settings {local} of the sliding_attention layers are not "
            "supported; eqllm's Gemma 3 reads the default rotary embedding there"
        )
    try:
        fields = rope_from_hf(
            {"rope_theta": hf.get("rope_theta", 1_000_000.0), "rope_parameters": full,
             "rope_scaling": hf.get("rope_scaling")},
            allowed=("default", "linear"),
        )  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{e} (the full_attention layers of Gemma 3)") from None
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    return {**fields, "positions.local_theta": float(local_theta)}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers' Gemma 3 never applies attn_logit_softcapping: refuse it rather than guess.
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            f"config.json attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not "
            "supported for Gemma 3 (transformers ignores it); set it to null"
        )
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or _PATTERN
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    return {**sandwich_from_hf(plain, pattern), **_rope(hf)}


FAMILY = Family(
    name="gemma3",
    released="2025-03",
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    fixed={
        **{k: v for k, v in SANDWICH_FIXED.items() if k != "positions.scaling"},
        "attention.qk_norm": "head",
        "attention.softcap": None,
    },
    table=TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=SANDWICH_KEYS
    | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    to_hf=to_hf,
    from_hf=from_hf,
    # transformers' Gemma3TextConfig defaults: the published 4B-27B config.json files nest the
    # language model in `text_config` and leave these out.
    defaults={
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "sliding_window": 4096,
    },
    check=lambda cfg: (
        {
            k: cfg.at(k)
            for k in (
                "attention.query_pre_attn_scalar",
                "attention.global_every",
                "attention.sliding_window",
                "positions.local_theta",
            )
            if cfg.at(k) is None
        }
        | (
            {"positions.scaling.kind": cfg.positions.scaling.kind}
            if cfg.positions.scaling is not None and cfg.positions.scaling.kind != "linear"
            else {}
        )
    ),
)
