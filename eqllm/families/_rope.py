"""config.json's RoPE settings <-> `ModelConfig.positions` (base and scaling), both layouts.

transformers 5 writes `rope_parameters` ({rope_type, rope_theta, factor, ...}); older files have
`rope_theta` and `rope_scaling` at the top level (the older one wins when both exist, as
transformers reads them). Each scaling kind reads its own keys; any other key is refused.
"""

from __future__ import annotations

from typing import Any

from eqllm.config import ConfigError, ModelConfig

_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# config.json key -> RopeScalingConfig field, per kind.
_KEYS = {
    "default": {},
    "linear": {"factor": "factor"},
    "llama3": {
        "factor": "factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_max_position_embeddings": "original_max_seq_len",
    },
    "yarn": {
        "factor": "factor",
        "original_max_position_embeddings": "original_max_seq_len",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim",
        "attention_factor": "attention_factor",
        "truncate": "truncate",
    },
    "longrope": {
        "factor": "factor",
        "original_max_position_embeddings": "original_max_seq_len",
        "attention_factor": "attention_factor",
        "short_factor": "short_factor",
        "long_factor": "long_factor",
    },
    "dynamic": {"factor": "factor"},
}
_ORIGINAL = ("llama3", "yarn", "longrope")  # kinds that name the original context


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The merged RoPE settings of either layout, with `rope_type` resolved ("default": none)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    rope = {**params, **scaling}
    rope_type = scaling.get("rope_type", scaling.get("type")) or params.get(
        "rope_type", params.get("type", "default")
    )
    return {**rope, "rope_type": rope_type}


def rope_from_hf(hf: dict[str, Any], allowed: tuple[str, ...] = tuple(_KEYS)) -> dict[str, Any]:
    """`positions.theta` and `positions.scaling` (dotted paths) from config.json.

    `allowed`: the scaling kinds the family's transformers class applies; others are refused.
    """
    rope = rope_params(hf)
    kind = rope["rope_type"]
    if kind not in _KEYS or kind not in allowed:
        raise ConfigError(
            f"rope scaling type {kind!r} in config.json is not supported; eqllm handles "
            f"{', '.join(repr(k) for k in allowed)} here"
        )
    unknown = sorted(set(rope) - _COMMON - set(_KEYS[kind]))
    if unknown:
        raise ConfigError(
            f"config.json rope settings {unknown} are not understood for rope_type {kind!r}"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"positions.theta": float(theta)}
    if kind == "default":
        fields["positions.scaling"] = None
        return fields
    scaling: dict[str, Any] = {"kind": kind}
    for key, name in _KEYS[kind].items():
        if rope.get(key) is not None:
            value = rope[key]
            scaling[name] = [float(v) for v in value] if isinstance(value, list) else value
    if kind in _ORIGINAL:
        # transformers: a top-level original_max_position_embeddings (Phi-3) wins, then the
        # rope settings' own, then max_position_embeddings.
        original = hf.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings"
        )
        scaling["original_max_seq_len"] = int(original or hf["max_position_embeddings"])
    if kind == "dynamic":  # the context the base starts growing past
        scaling["original_max_seq_len"] = int(hf.get("max_position_embeddings", 2048))
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if scaling.get(name) is not None:
            scaling[name] = float(scaling[name])
    fields["positions.scaling"] = scaling
    return fields


def rope_scaling_to_hf(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for `cfg` (None for plain RoPE)."""
    s = cfg.positions.scaling
    if s is None:
        return None
    out: dict[str, Any] = {"rope_type": s.kind}
    for key, name in _KEYS[s.kind].items():
        value = getattr(s, name)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def max_position_embeddings(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: the context, except with dynamic scaling, where
    transformers grows the base past it (eqllm's `original_max_seq_len`)."""
    s = cfg.positions.scaling
    return s.original_max_seq_len if s is not None and s.kind == "dynamic" else cfg.max_seq_len
