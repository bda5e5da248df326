"""Gemma 3, text only (Gemma Team, 2025, "Gemma 3 Technical Report"): Gemma 2's block with
QK-norm ((1 + w) RMSNorm over each head) in place of soft-capping, five local (sliding-window)
layers to one global, and a RoPE base of its own for the local layers."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import LLAMA_PREFIX, Family, rows
from eqllm.families.gemma2 import (
    SANDWICH_FIXED,
    SANDWICH_KEYS,
    SANDWICH_TABLE,
    sandwich_from_hf,
    sandwich_to_hf,
)

TABLE = SANDWICH_TABLE + rows(
    ("model.layers.{i}.self_attn.q_norm.weight", "blocks.attn.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blocks.attn.k_norm.weight"),
)
_PATTERN = 6  # transformers' default sliding_window_pattern


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = sandwich_to_hf(cfg)
    del out["rope_scaling"]  # Gemma 3 puts scaling on the global layers only; none here
    # The older layout, which transformers 5 converts into per-layer-type rope_parameters.
    return {
        **out,
        "rope_local_base_freq": cfg.positions.local_theta,
        "sliding_window_pattern": cfg.attention.global_every,
    }


def _rope(hf: dict[str, Any]) -> dict[str, float]:
    """The global and local RoPE bases, from either config.json layout; only default RoPE."""
    params = hf.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict(params.get("full_attention") or {}) if nested else {}
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    if not nested and params:
        full = dict(params)
    full.update(hf.get("rope_scaling") or {})
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
            raise ConfigError(
                f"config.json rope settings {rope} of the {kind} layers are not supported; "
                "eqllm's Gemma 3 reads the default rotary embedding only"
            )
    return {
        "positions.theta": float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        "positions.local_theta": float(
            local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        ),
    }


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
    fixed={**SANDWICH_FIXED, "attention.qk_norm": "head", "attention.softcap": None},
    table=TABLE,
    prefix=LLAMA_PREFIX,
    hf_keys=SANDWICH_KEYS
    | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    to_hf=to_hf,
    from_hf=from_hf,
    check=lambda cfg: {
        k: cfg.at(k)
        for k in (
            "attention.query_pre_attn_scalar",
            "attention.global_every",
            "attention.sliding_window",
            "positions.local_theta",
        )
        if cfg.at(k) is None
    },
)
