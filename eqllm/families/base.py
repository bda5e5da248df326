"""What a family file declares, and the Hugging Face translation several families share.

A `Family` holds everything particular to one architecture family: its Hugging Face names, the
`ModelConfig` fields it fixes, its weight key table and its config translation both ways. The
generic code in `eqllm.hub` reads only these; nothing outside a family file says
`if family == ...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.experts import PLAIN_EXPERTS as PLAIN_EXPERTS  # the families' import
from eqllm.families._rope import max_position_embeddings, rope_from_hf, rope_scaling_to_hf


@dataclasses.dataclass(frozen=True)
class Row:
    """One Hugging Face tensor and the eqllm array(s) it holds.

    `hf` is the tensor name, with `{i}` for the layer index (then the row fills the leading
    `layers` axis of the stacked blocks) and `{j}` for the expert index (one tensor per expert,
    filling the `expert` axis that follows). Several `eqllm` paths mean a fused tensor, split
    along its axis `axis` (the output axis: 0, or 1 for transformers' fused experts
    [experts, out, in]) on the way in and concatenated on the way out. `conv1d` marks GPT-2's
    Conv1D, which stores a weight (in, out): transposed. `per_head` marks a fused tensor whose
    parts are interleaved per attention head, its fused axis viewed as [n_heads, parts, size /
    n_heads] (GPT-NeoX's query_key_value: q, k and v of head 0, then of head 1, ...) rather than
    one part after the other; `interleaved` one whose parts alternate entry by entry (gpt-oss's
    gate_up_proj: gate 0, up 0, gate 1, ...). `transposed` marks matrices stored (in, out), as
    tensors used as x @ W are (gpt-oss's experts): the last two axes swapped. `depthwise` marks
    torch's depthwise Conv1d weight [channels, 1, kernel], held without its middle axis.
    `parts` marks the one eqllm array stored as several tensors, concatenated along `axis`:
    (part, path) pairs, each tensor named with `{part}` in `hf` replaced by its part and as
    long along `axis` as the eqllm array at `path` (OLMo hybrid's q_conv1d, k_conv1d and
    v_conv1d, as many channels as q_proj, k_proj and v_proj have rows). `heads`: the
    ModelConfig path of a `per_head` row's head count (Qwen3-Next's Gated DeltaNet groups its
    fused projections by key head: "linear.n_key_heads"). `experts`: the row belongs only to a
    model with (True) or without (False) experts, where both hold arrays at its eqllm paths
    (Granite's dense MLP and its experts; None: any model). `module` False: the tensor is not
    a linear module of its own in transformers' model, so PEFT cannot name it (Granite's fused
    experts, whose checkpoint names end in ".weight").
    """

    hf: str
    eqllm: tuple[str, ...]
    conv1d: bool = False
    axis: int = 0
    per_head: bool = False
    interleaved: bool = False
    transposed: bool = False
    depthwise: bool = False
    parts: tuple[tuple[str, str], ...] = ()
    heads: str = "attention.n_heads"
    experts: bool | None = None
    module: bool = True

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf


def rows(*specs: tuple, axis: int = 0, per_head: bool = False, **layout: Any) -> tuple[Row, ...]:
    """Rows from `(hf, eqllm_path_or_paths[, conv1d])` tuples, fused along `axis` (interleaved
    per attention head if `per_head`); `layout`: `interleaved`, `transposed`, `depthwise`,
    `parts` and `heads` (see `Row`)."""
    out = []
    for hf, eqllm, *conv1d in specs:
        paths = (eqllm,) if isinstance(eqllm, str) else tuple(eqllm)
        out.append(Row(hf, paths, *conv1d, axis=axis, per_head=per_head, **layout))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture family, as `eqllm/families/<name>.py` declares it.

    Arguments:
        name: the value of `ModelConfig.family`.
        released: year and month of the first release ("2023-02"); orders the zoo.
        architecture: the transformers class a checkpoint names (`LlamaForCausalLM`).
        model_type: the `model_type` of its config.json.
        fixed: ModelConfig settings the family fixes, by dotted path ("attention.qk_norm"); a
            config that differs has no HF counterpart.
        table: the weight key table (rows whose eqllm arrays a config lacks are skipped).
        prefix: prefix of the base model's tensor names, which bare checkpoints omit.
        hf_keys: config.json keys the translation reads or checks (beyond `COMMON_KEYS` and
            what `is_metadata` accepts); any other key is refused.
        to_hf: the family's config.json fields for a config (besides the common ones).
        from_hf: ModelConfig settings by dotted path from a config.json dict (besides `fixed`).
        check: extra invariants: returns the offending {path: value} (empty when fine).
        layouts: other key tables a checkpoint of the family may use, accepted on import (the
            first table whose tensors the checkpoint has is read; export writes `table`).
        defaults: config.json values that transformers' config class assumes where a file
            leaves the key out (published files rely on them: Gemma 3's text_config names no
            head counts); a key the file sets, even to null, keeps the file's value.
        skip_extra_layers: checkpoints may hold layers numbered from num_hidden_layers on
            (DeepSeek's multi-token-prediction layers), which import skips with a message.
        gguf: llama.cpp's architecture (GGUF `general.architecture`) the family is written
            as (`eqllm.hub.save_gguf`); None: eqllm writes no GGUF file for it.
        gguf_refuses: settings of a config that architecture cannot hold: returns the
            offending {path: value} (empty when the model can be written).
        module_renames: checkpoint module names transformers renames in the model it builds
            (GPT-NeoX's `embed_out` is `lm_head`): PEFT adapters name modules, so eqllm writes
            the new name and reads either.
        also_reads: other `model_type` values of config.json files the family reads (Kimi K2
            ships DeepSeek-V3's architecture as "kimi_k2"); export writes `model_type`.
        wrapper: the `model_type` of a vision-language config.json that holds this family's
            config in `text_config` (Qwen3.5's `qwen3_5`): import reads the language model and
            says in one line that the vision tower is left out.
        ignored: a pattern of checkpoint tensor names import skips, with one line saying so
            (a vision tower, multi-token-prediction layers); None: every tensor must be read.
    """

    name: str
    released: str
    architecture: str
    model_type: str
    fixed: dict[str, Any]
    table: tuple[Row, ...]
    prefix: str
    hf_keys: frozenset[str]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    check: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    layouts: tuple[tuple[Row, ...], ...] = ()
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    skip_extra_layers: bool = False
    gguf: str | None = None
    gguf_refuses: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    module_renames: dict[str, str] = dataclasses.field(default_factory=dict)
    also_reads: tuple[str, ...] = ()
    wrapper: str | None = None
    ignored: str | None = None

    @property
    def embed_name(self) -> str:
        """The token embedding's tensor name without the base-model prefix."""
        row = next(r for r in self.table if r.eqllm == ("embed.weight",))
        return row.hf.removeprefix(self.prefix)


# A dense family has no experts: export refuses a config with them.
DENSE = {"moe": None}

# The switches only some recent families turn on, at their plain settings: a family that does
# not read one from config.json fixes it here, so export refuses a config that sets it. Keys
# are dotted paths of ModelConfig (`ModelConfig.at`).
PLAIN = {
    "norms.pre": True,
    "norms.post": False,
    "attention.softcap": None,
    "final_softcap": None,
    "attention.global_every": None,
    "positions.local_theta": None,
    "attention.query_pre_attn_scalar": None,
    "positions.fraction": 1.0,
    "parallel_residual": False,
    "mlp.gelu": "tanh",
    "attention.sinks": False,
    "positions.nope_every": None,
    "attention.kind": "gqa",
    "attention.output_gate": False,
    "attention.chunk_size": None,
    "attention.rope_interleave": False,
    "attention.temperature_floor": None,
    "linear": None,
    "multipliers": None,
    "per_layer": None,
    "attention.kv_shared_layers": None,
    "mlp.kv_shared_d_ff": None,
    **DENSE,
}

# The Llama block the Llama-layout families start from: RMSNorm before each sublayer, SwiGLU,
# rotary positions, no QK-norm, no embedding scale; each family adds what it fixes besides.
LLAMA_BLOCK = {
    **PLAIN,
    "norms.kind": "rmsnorm",
    "norms.plus_one": False,
    "mlp.kind": "swiglu",
    "positions.kind": "rope",
    "attention.qk_norm": None,
    "embed_scale": False,
}


# What a config.json may carry besides the architecture, none of which changes what the model
# computes. `is_metadata` accepts by rule: names transformers keeps private (a leading "_":
# _name_or_path, _attn_implementation_autoset), special token ids (`*_token_id`), the
# bookkeeping fields transformers' PretrainedConfig defines for every model (as transformers 4
# and 5 write them, and output_past, transformers 2's name for use_cache, which GPT-2's published
# files still carry) and the generation defaults of its GenerationConfig.
# tests/test_hf_configs.py checks both lists against the installed transformers; eqllm does not
# import it to load.
CONFIG_BOOKKEEPING = frozenset(
    """
    architectures model_type transformers_version torch_dtype dtype name_or_path
    output_hidden_states output_attentions return_dict use_return_dict torchscript
    chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention
    cross_attention_hidden_size tie_encoder_decoder id2label label2id num_labels problem_type
    finetuning_task tokenizer_class prefix task_specific_params use_bfloat16 tf_legacy_loss
    attn_implementation experts_implementation output_past
    """.split()
)
GENERATION_KEYS = frozenset(
    """
    assistant_confidence_threshold assistant_early_exit assistant_ensemble_weight
    assistant_lookbehind bad_words_ids begin_suppress_tokens cache_config cache_implementation
    compile_config constraints continuous_batching_config disable_compile diversity_penalty
    do_sample dola_layers early_stopping encoder_no_repeat_ngram_size
    encoder_repetition_penalty epsilon_cutoff eta_cutoff exponential_decay_length_penalty
    force_words_ids guidance_scale is_assistant
    length_penalty low_memory max_cache_len max_length max_matching_ngram_size max_new_tokens
    max_time min_length min_new_tokens min_p no_repeat_ngram_size num_assistant_tokens
    num_assistant_tokens_schedule num_beam_groups num_beams num_return_sequences output_logits
    output_scores penalty_alpha prefill_chunk_size prompt_lookup_num_tokens
    remove_invalid_values renormalize_logits repetition_penalty return_dict_in_generate
    sequence_bias speculation_type stop_strings suppress_tokens target_lookbehind temperature
    token_healing top_h top_k top_p typical_p use_cache use_mtp watermarking_config
    """.split()
)
# Read by the hub for every family: the vocabulary and the tied head; and two that only training
# from scratch would use: the initialisation scale and attention dropout (eqllm has none).
COMMON_KEYS = frozenset(
    {"vocab_size", "tie_word_embeddings", "initializer_range", "attention_dropout"}
)


def is_metadata(key: str) -> bool:
    """Whether a config.json key is bookkeeping that leaves the computation unchanged."""
    return (
        key.startswith("_")
        or key.endswith(("_token_id", "_token_ids"))
        or key in CONFIG_BOOKKEEPING
        or key in GENERATION_KEYS
    )


def token_ids(cfg: ModelConfig, defaults: dict[str, int]) -> dict[str, int | None]:
    """A family's default special token ids, None where outside the config's vocabulary
    (transformers warns about those, or refuses a padding id outside the embedding)."""
    return {k: (v if v < cfg.vocab_size else None) for k, v in defaults.items()}


def refuse(hf: dict[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    """Raise unless config.json's `key` is absent or one of `allowed`."""
    if key in hf and hf[key] not in allowed:
        raise ConfigError(
            f"config.json {key}={hf[key]!r} is not supported; eqllm handles {list(allowed)}"
        )


def need(hf: dict[str, Any], key: str) -> Any:
    """config.json's `key`, which must be set."""
    if hf.get(key) is None:
        raise ConfigError(f"config.json of a {hf['model_type']} model must set {key!r}")
    return hf[key]


# The Llama layout: Llama, Mistral, Qwen2, Qwen3 and Gemma checkpoints share these names and
# config keys (they differ in which rows exist and which keys they read).

LLAMA_TABLE = rows(
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.attn.q_proj.weight"),
    ("model.layers.{i}.self_attn.q_proj.bias", "blocks.attn.q_proj.bias"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.attn.k_proj.weight"),
    ("model.layers.{i}.self_attn.k_proj.bias", "blocks.attn.k_proj.bias"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.attn.v_proj.weight"),
    ("model.layers.{i}.self_attn.v_proj.bias", "blocks.attn.v_proj.bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
    ("model.layers.{i}.self_attn.o_proj.bias", "blocks.attn.o_proj.bias"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.mlp.gate.weight"),
    ("model.layers.{i}.mlp.gate_proj.bias", "blocks.mlp.gate.bias"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.mlp.up.weight"),
    ("model.layers.{i}.mlp.up_proj.bias", "blocks.mlp.up.bias"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.mlp.down.weight"),
    ("model.layers.{i}.mlp.down_proj.bias", "blocks.mlp.down.bias"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
# QK-norm's two weights in the Llama layout (Qwen3, Gemma 3, OLMo 2 and their mixtures).
QK_NORM_ROWS = rows(
    ("model.layers.{i}.self_attn.q_norm.weight", "blocks.attn.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blocks.attn.k_norm.weight"),
)
LLAMA_PREFIX = "model."
LLAMA_KEYS = frozenset(
    """
    hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
    head_dim max_position_embeddings rms_norm_eps hidden_act rope_theta rope_scaling
    rope_parameters
    """.split()
)


def attention_bias_from_hf(hf: dict[str, Any]) -> dict[str, bool]:
    """The q/k/v and output biases from config.json's one `attention_bias` switch."""
    bias = bool(hf.get("attention_bias", False))
    return {"attention.qkv_bias": bias, "attention.out_bias": bias}


def one_attention_bias(cfg: ModelConfig) -> dict[str, Any]:
    """A `check`: one `attention_bias` switch cannot express q/k/v and output biases that differ."""
    attn = cfg.attention
    return {} if attn.qkv_bias == attn.out_bias else {"attention.out_bias": attn.out_bias}


def llama_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields every Llama-layout family writes."""
    return {
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "num_key_value_heads": cfg.attention.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_position_embeddings(cfg),
        "rms_norm_eps": cfg.norms.eps,
        "attention_dropout": 0.0,
        "rope_theta": cfg.positions.theta,
        "rope_scaling": rope_scaling_to_hf(cfg),
    }


def llama_from_hf(hf: dict[str, Any], eps: float = 1e-6) -> dict[str, Any]:
    """The ModelConfig fields every Llama-layout family reads from config.json. `eps` is the
    `rms_norm_eps` of the family's transformers config class, which a config.json may leave out
    (OLMoE-1B-7B-0924's does)."""
    d = need(hf, "hidden_size")
    n_heads = need(hf, "num_attention_heads")
    return {
        **rope_from_hf(hf),
        "vocab_size": need(hf, "vocab_size"),
        "d_model": d,
        "n_layers": need(hf, "num_hidden_layers"),
        "attention.n_heads": n_heads,
        "attention.n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "attention.head_dim": hf.get("head_dim") or d // n_heads,
        "mlp.d_ff": need(hf, "intermediate_size"),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "norms.eps": hf.get("rms_norm_eps", eps),
    }


def full_attention_only(hf: dict[str, Any], family: str) -> None:
    """Refuse a config.json whose `layer_types` asks for anything but full attention."""
    layer_types = set(hf.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        raise ConfigError(
            f"config.json layer_types={sorted(layer_types)}: eqllm's {family} has only "
            "'full_attention' layers"
        )


# Local/global layers (Gemma 2 and 3, OLMo 3): config.json's `layer_types` <-> ModelConfig's
# `attention.global_every`, every global_every-th layer attending to the whole context.


def layer_types(cfg: ModelConfig) -> list[str]:
    """config.json's `layer_types` for `cfg`'s local/global pattern."""
    return ["sliding_attention" if w else "full_attention" for w in cfg.local_layers()]


def global_every(hf: dict[str, Any], default: int) -> int:
    """The period of the local/global pattern of `layer_types` (`default` when absent)."""
    types = hf.get("layer_types")
    if not types:
        return default
    every = types.index("full_attention") + 1 if "full_attention" in types else default
    expected = [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(len(types))
    ]
    if types != expected:
        raise ConfigError(
            f"config.json layer_types={types} is not a repeating pattern of sliding layers "
            "closed by one full-attention layer, the only pattern eqllm reads"
        )
    return every
