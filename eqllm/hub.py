"""Hugging Face format interop: config translation (weights follow the same tables).

`to_hf_config` writes the `config.json` dict transformers expects for a family;
`from_hf_config` reads one back and refuses settings it does not understand, instead of
silently building a different model.
"""

from __future__ import annotations

from typing import Any

from eqllm.config import ConfigError, ModelConfig

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
}


def _rope_fields(cfg: ModelConfig) -> dict[str, Any]:
    fields: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_scaling": None}
    if cfg.rope_scaling == "llama3":
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return fields


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers `config.json` contents for `cfg` (raises if HF has no such model)."""
    _check_exportable(cfg)
    common = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.family == "gpt2":
        return {
            **common,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    llama_like = {
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim_per_head,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_dropout": 0.0,
        **_rope_fields(cfg),
    }
    if cfg.family == "llama":
        return {
            **llama_like,
            "hidden_act": "silu",
            "attention_bias": cfg.qkv_bias,
            "mlp_bias": cfg.mlp_bias,
        }
    if cfg.family == "mistral":
        return {**llama_like, "hidden_act": "silu", "sliding_window": cfg.sliding_window}
    if cfg.family == "qwen2":
        return {
            **llama_like,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "sliding_window": None,
        }
    return {
        **llama_like,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    }


# What each family fixes; a ModelConfig that differs has no Hugging Face counterpart.
_FAMILY_INVARIANTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "norm": "layernorm",
        "norm_bias": True,
        "mlp": "gelu",
        "position": "learned",
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "tie_embeddings": True,
        "sliding_window": None,
        "qk_norm": False,
        "embed_scale": False,
        "head_dim": None,
    },
    "llama": {
        "norm": "rmsnorm",
        "norm_plus_one": False,
        "mlp": "swiglu",
        "position": "rope",
        "sliding_window": None,
        "qk_norm": False,
        "embed_scale": False,
    },
    "mistral": {
        "norm": "rmsnorm",
        "norm_plus_one": False,
        "mlp": "swiglu",
        "position": "rope",
        "qkv_bias": False,
        "out_bias": False,
        "mlp_bias": False,
        "qk_norm": False,
        "embed_scale": False,
        "rope_scaling": "none",
    },
    "qwen2": {
        "norm": "rmsnorm",
        "norm_plus_one": False,
        "mlp": "swiglu",
        "position": "rope",
        "qkv_bias": True,
        "out_bias": False,
        "mlp_bias": False,
        "sliding_window": None,
        "qk_norm": False,
        "embed_scale": False,
        "rope_scaling": "none",
    },
    "gemma": {
        "norm": "rmsnorm",
        "norm_plus_one": True,
        "mlp": "geglu",
        "position": "rope",
        "qkv_bias": False,
        "out_bias": False,
        "mlp_bias": False,
        "sliding_window": None,
        "qk_norm": False,
        "embed_scale": True,
        "tie_embeddings": True,
        "rope_scaling": "none",
    },
}


def _check_exportable(cfg: ModelConfig) -> None:
    wrong = {
        k: getattr(cfg, k)
        for k, v in _FAMILY_INVARIANTS[cfg.family].items()
        if getattr(cfg, k) != v
    }
    if cfg.family == "llama" and cfg.qkv_bias != cfg.out_bias:
        wrong["out_bias"] = cfg.out_bias  # Llama's attention_bias sets both
    if wrong:
        raise ConfigError(
            f"this {cfg.family} config has no Hugging Face equivalent: {wrong} differ from what "
            f"{ARCHITECTURES[cfg.family]} fixes ({_FAMILY_INVARIANTS[cfg.family]})"
        )


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a transformers `config.json` dict; unsupported settings are errors."""
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported model_type {family!r} in config.json; eqllm reads {sorted(ARCHITECTURES)}"
        )
    base = {k: v for k, v in _FAMILY_INVARIANTS[family].items()}
    if family == "gpt2":
        _refuse(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"))
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ConfigError(
                "GPT-2 attention variants (scale_attn_by_inverse_layer_idx, "
                "reorder_and_upcast_attn) are not supported"
            )
        d = hf.get("n_embd", 768)
        return ModelConfig(
            **base,
            family="gpt2",
            vocab_size=hf.get("vocab_size", 50257),
            d_model=d,
            n_layers=hf.get("n_layer", 12),
            n_heads=hf.get("n_head", 12),
            d_ff=hf.get("n_inner") or 4 * d,
            max_seq_len=hf.get("n_positions", 1024),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if family == "gemma":
        _refuse({"hidden_act": act}, "hidden_act", ("gelu_pytorch_tanh", "gelu"))
    else:
        _refuse(hf, "hidden_act", ("silu",))
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    fields: dict[str, Any] = {}
    if rope_type == "llama3":
        fields = {
            "rope_scaling": "llama3",
            "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
        }
    elif rope_type != "default":
        raise ConfigError(
            f"rope scaling type {rope_type!r} in config.json is not supported; eqllm handles "
            "the default rotary embedding and 'llama3' scaling"
        )
    if family == "llama":
        fields["qkv_bias"] = fields["out_bias"] = bool(hf.get("attention_bias", False))
        fields["mlp_bias"] = bool(hf.get("mlp_bias", False))
        fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if family == "mistral":
        fields["sliding_window"] = hf.get("sliding_window")
        base.pop("sliding_window", None)
        fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if family == "qwen2":
        if hf.get("use_sliding_window"):
            raise ConfigError("Qwen2 with use_sliding_window=true is not supported")
        fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    d = hf["hidden_size"]
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return ModelConfig(
        **{**base, **fields},
        family=family,
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=None if head_dim in (None, d // n_heads) else head_dim,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
    )


def _refuse(hf: dict[str, Any], key: str, allowed: tuple[str, ...]) -> None:
    if key in hf and hf[key] not in allowed:
        raise ConfigError(
            f"config.json {key}={hf[key]!r} is not supported; eqllm handles {list(allowed)}"
        )
