"""OLMo 3 (Team OLMo, 2025, "Olmo 3"): OLMo 2's block (RMSNorm on the outputs of attention and
MLP, QK-norm over the whole q and k projections) with three sliding-window layers to one
full-attention layer, each layer type with its own RoPE settings: the long-context releases
stretch the full-attention layers' RoPE with YaRN and leave the windowed layers' plain."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._rope import rope_from_hf, rope_scaling_to_hf
from eqllm.families.base import (
    LLAMA_PREFIX,
    Family,
    global_every,
    layer_types,
    need,
)
from eqllm.families.olmo2 import FAMILY as OLMO2

_PATTERN = 4  # Olmo3Config's default layer_types: every fourth layer attends to everything
_THETA = 500000.0  # Olmo3Config's default_theta
_SCALINGS = ("default", "linear", "llama3", "yarn")  # transformers' kinds that need no sequence
# What OLMo 2 fixes and OLMo 3 reads per layer type: the window and the windowed layers' base.
_PER_LAYER = ("attention.sliding_window", "attention.global_every", "positions.local_theta")


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # transformers 5's layout: one rope_parameters entry per layer type. The windowed layers are
    # never scaled (eqllm's RotaryEmbedding leaves `local_theta` layers plain, as Olmo3 does).
    hf = {k: v for k, v in OLMO2.to_hf(cfg).items() if k not in ("rope_theta", "rope_scaling")}
    full = rope_scaling_to_hf(cfg) or {"rope_type": "default"}
    return {
        **hf,
        "sliding_window": cfg.attention.sliding_window,
        "layer_types": layer_types(cfg),
        "rope_parameters": {
            "full_attention": {**full, "rope_theta": cfg.positions.theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.positions.local_theta},
        },
    }


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' RoPE base and scaling and the windowed layers' base, read as
    transformers' Olmo3Config reads either config.json layout."""
    params = hf.get("rope_parameters") or {}
    if params and not {"full_attention", "sliding_attention"} >= set(params):
        raise ConfigError(
            f"config.json rope_parameters={params} is not per layer type; eqllm's OLMo 3 reads "
            "{'full_attention': {...}, 'sliding_attention': {...}}"
        )
    full = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    local = dict(params.get("sliding_attention") or {})
    theta = hf.get("rope_theta")
    if "rope_theta" not in local and theta is not None and float(theta) != _THETA:
        # transformers 5 gives such windowed layers its default base, transformers 4 this one.
        raise ConfigError(
            f"config.json rope_theta={theta} without rope_parameters['sliding_attention'] leaves "
            "the sliding-window layers' RoPE base ambiguous; write rope_parameters per layer type"
        )
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
        raise ConfigError(
            f"config.json rope settings {local} of the sliding_attention layers are not "
            "supported; eqllm's OLMo 3 reads the default rotary embedding there"
        )
    full.setdefault("rope_theta", _THETA if theta is None else theta)
    try:
        fields = rope_from_hf(
            {
                "rope_parameters": full,
                "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            },
            allowed=_SCALINGS,
        )
    except ConfigError as e:
        raise ConfigError(f"{e} (the full_attention layers of OLMo 3)") from None
    return {**fields, "positions.local_theta": float(local.get("rope_theta", _THETA))}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    return {
        **OLMO2.from_hf(plain),
        **_rope(hf),
        "attention.sliding_window": need(hf, "sliding_window"),
        "attention.global_every": global_every(hf, _PATTERN),
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """Written as llama.cpp's olmo2 (`olmo2.gguf_refuses`), whose windowed layers rotate with
    the full layers' base: its graph passes `freq_base`, not the file's `rope.freq_base_swa`."""
    theta, local = cfg.positions.theta, cfg.positions.local_theta
    return {
        **OLMO2.gguf_refuses(cfg),
        **({"positions.local_theta": local} if local != theta else {}),
    }


FAMILY = Family(
    name="olmo3",
    released="2025-11",
    architecture="Olmo3ForCausalLM",
    model_type="olmo3",
    fixed={k: v for k, v in OLMO2.fixed.items() if k not in _PER_LAYER},
    table=OLMO2.table,
    prefix=LLAMA_PREFIX,
    hf_keys=OLMO2.hf_keys | {"sliding_window", "layer_types"},
    to_hf=to_hf,
    from_hf=from_hf,
    # Olmo3Config's defaults for keys a config.json leaves out.
    defaults={"sliding_window": 4096},
    # transformers' Olmo3 always has both layer types' RoPE and a window on the sliding layers.
    check=lambda cfg: {
        **OLMO2.check(cfg),
        **{k: cfg.at(k) for k in _PER_LAYER if cfg.at(k) is None},
        **(
            {"positions.scaling.kind": cfg.positions.scaling.kind}
            if cfg.positions.scaling is not None and cfg.positions.scaling.kind not in _SCALINGS
            else {}
        ),
    },
    gguf="olmo2",
    gguf_refuses=gguf_refuses,
)
