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


_GPT2_END_OF_TEXT = 50256


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
        # GPT2Config defaults bos/eos to 50256 (GPT-2's <|endoftext|>), outside a smaller
        # vocabulary; transformers then warns and generation would use an invalid id.
        end_of_text = _GPT2_END_OF_TEXT if cfg.vocab_size > _GPT2_END_OF_TEXT else None
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
            "bos_token_id": end_of_text,
            "eos_token_id": end_of_text,
        }
    llama_like = {
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
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
        if getattr(cfg, k) != (cfg.d_model // cfg.n_heads if k == "head_dim" and v is None else v)
    }
    if cfg.family == "llama" and cfg.qkv_bias != cfg.out_bias:
        wrong["out_bias"] = cfg.out_bias  # Llama's attention_bias sets both
    if wrong:
        raise ConfigError(
            f"this {cfg.family} config has no Hugging Face equivalent: {wrong} differ from what "
            f"{ARCHITECTURES[cfg.family]} fixes ({_FAMILY_INVARIANTS[cfg.family]})"
        )


# Keys of any transformers config that do not change what the model computes (bookkeeping,
# token ids, generation defaults, dropout, which has no effect at inference and none in eqllm).
_HARMLESS = frozenset(
    """
    architectures model_type transformers_version _name_or_path torch_dtype dtype
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id use_cache
    initializer_range return_dict output_hidden_states output_attentions torchscript id2label
    label2id num_labels problem_type tokenizer_class prefix task_specific_params finetuning_task
    is_decoder is_encoder_decoder chunk_size_feed_forward pruned_heads tf_legacy_loss
    use_bfloat16 _attn_implementation_autoset max_length min_length do_sample early_stopping
    num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences output_scores return_dict_in_generate
    forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    attention_dropout tie_word_embeddings vocab_size
    """.split()
)
_LLAMA_KEYS = """
    hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
    head_dim max_position_embeddings rms_norm_eps hidden_act rope_theta rope_scaling
    rope_parameters
""".split()
# The keys each family's translation reads (or checks); any other key is refused.
_KNOWN_KEYS = {
    "gpt2": _HARMLESS
    | set(
        """
        n_embd n_layer n_head n_inner n_positions n_ctx activation_function layer_norm_epsilon
        resid_pdrop embd_pdrop attn_pdrop scale_attn_weights scale_attn_by_inverse_layer_idx
        reorder_and_upcast_attn add_cross_attention summary_type summary_use_proj
        summary_activation summary_proj_to_labels summary_first_dropout
        """.split()
    ),
    "llama": _HARMLESS | {*_LLAMA_KEYS, "attention_bias", "mlp_bias", "pretraining_tp"},
    "mistral": _HARMLESS | {*_LLAMA_KEYS, "sliding_window"},
    "qwen2": _HARMLESS
    | {*_LLAMA_KEYS, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "gemma": _HARMLESS
    | {*_LLAMA_KEYS, "hidden_activation", "attention_bias", "use_bidirectional_attention"},
}
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a transformers `config.json` dict; unsupported settings are errors.

    Reads both the transformers 5 layout (`rope_parameters` holding `rope_theta` and the
    scaling) and the older one (`rope_theta` and `rope_scaling` at the top level). A key that
    is not known to leave the computation unchanged is refused, naming the key.
    """
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported model_type {family!r} in config.json; eqllm reads {sorted(ARCHITECTURES)}"
        )
    unknown = sorted(set(hf) - _KNOWN_KEYS[family])
    if unknown:
        raise ConfigError(
            f"config.json has {family} setting(s) eqllm does not understand: {unknown}; "
            "refusing rather than building a model that may compute something else"
        )
    base = {k: v for k, v in _FAMILY_INVARIANTS[family].items()}
    if family == "gpt2":
        _refuse(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"))
        _refuse(hf, "scale_attn_weights", (True,))
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            _refuse(hf, key, (False, None))
        _refuse(hf, "add_cross_attention", (False, None))
        _refuse(hf, "tie_word_embeddings", (True,))
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
    if family == "gemma":
        # "gelu" is the legacy value of Gemma's releases; transformers maps it to the tanh form.
        _refuse(hf, "hidden_act", ("gelu_pytorch_tanh", "gelu"))
        _refuse(hf, "hidden_activation", ("gelu_pytorch_tanh", "gelu", None))
        _refuse(hf, "attention_bias", (False,))
        _refuse(hf, "use_bidirectional_attention", (False, None))
        _refuse(hf, "tie_word_embeddings", (True,))
    else:
        _refuse(hf, "hidden_act", ("silu",))
    fields = _rope_from_hf(hf)
    if family == "llama":
        fields["qkv_bias"] = fields["out_bias"] = bool(hf.get("attention_bias", False))
        fields["mlp_bias"] = bool(hf.get("mlp_bias", False))
    if family in ("llama", "mistral", "qwen2"):
        fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if family == "mistral":
        fields["sliding_window"] = hf.get("sliding_window")
        base.pop("sliding_window", None)
    if family == "qwen2":
        _refuse(hf, "use_sliding_window", (False, None))
        layer_types = set(hf.get("layer_types") or ())
        if layer_types - {"full_attention"}:
            raise ConfigError(
                f"config.json layer_types={sorted(layer_types)}: eqllm's Qwen2 has only "
                "'full_attention' layers"
            )
    d = _need(hf, "hidden_size")
    n_heads = _need(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    return ModelConfig(
        **{**base, **fields},
        family=family,
        vocab_size=_need(hf, "vocab_size"),
        d_model=d,
        n_layers=_need(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=None if head_dim in (None, d // n_heads) else head_dim,
        d_ff=_need(hf, "intermediate_size"),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the scaling fields, from either config layout."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})  # the older layout; it wins when both exist
    rope = {**params, **scaling}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type")) or params.get(
        "rope_type", params.get("type", "default")
    )
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(
            f"rope scaling type {rope_type!r} in config.json is not supported; eqllm handles "
            "the default rotary embedding and 'llama3' scaling"
        )
    unknown = sorted(set(rope) - _ROPE_KEYS[rope_type])
    if unknown:
        raise ConfigError(
            f"config.json rope settings {unknown} are not understood for rope_type {rope_type!r}"
        )
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    if rope_type == "llama3":
        fields.update(
            rope_scaling="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
    return fields


def _need(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json of a {hf['model_type']} model must set {key!r}")
    return hf[key]


def _refuse(hf: dict[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    if key in hf and hf[key] not in allowed:
        raise ConfigError(
            f"config.json {key}={hf[key]!r} is not supported; eqllm handles {list(allowed)}"
        )
