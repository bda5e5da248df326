"""Gemma 4, text model (Google DeepMind, 2026): Gemma 3's sandwich block (a norm before and after
both attention and MLP, local sliding-window layers closed by a global one, QK-norm, scaled
embeddings, soft-capped final logits) with plain-weight RMSNorms (w, not 1 + w), a weightless
RMSNorm on the values (`attention.v_norm`), unscaled attention scores (query_pre_attn_scalar 1:
the QK-norm sets their size) and a stored scalar multiplying each layer's output
(`norms.layer_scalar`).

The global layers may have a shape of their own, a stack of layer kind "global"
(`eqllm.config.kinds`): wider heads (`global_head_dim` -> `attention.global_head_dim`), fewer kv
heads whose values are their keys (`attention_k_eq_v`, `num_global_key_value_heads` ->
`attention.k_eq_v`, `attention.global_kv_heads`) and proportional RoPE on a fraction of their
frequencies (`rope_parameters.full_attention.partial_rotary_factor` ->
`positions.global_fraction`).

E2B and E4B add per-layer input embeddings (`hidden_size_per_layer_input`,
`vocab_size_per_layer_input` -> `per_layer.d`, `per_layer.vocab_size`) and key/value caches
shared by the last layers (`num_kv_shared_layers` -> `attention.kv_shared_layers`; each shared
layer attends to the keys and values of the last earlier layer of its type and holds no cache),
whose MLP may be twice as wide (`use_double_wide_mlp` -> `mlp.kv_shared_d_ff` = 2 x d_ff); see
`eqllm.config.per_layer`. 26B-A4B's mixture-of-experts block (`enable_moe_block`: the dense MLP
and the experts side by side in every layer) is `eqllm.families._gemma4_moe`'s.

Published checkpoints are multimodal (`gemma4`, `Gemma4ForConditionalGeneration`): eqllm reads
the language model (`text_config`, `model.language_model.*`) and leaves the vision and audio
towers and their embedders out.
"""

import dataclasses
from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._gemma4_moe import check_experts, experts_from_hf, experts_to_hf, with_experts
from eqllm.families.base import (
    LLAMA_KEYS,
    QK_NORM_ROWS,
    Family,
    global_every,
    layer_types,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
    rows,
)
from eqllm.families.gemma2 import GELU_TANH, SANDWICH_TABLE

# transformers' Gemma4TextConfig defaults for the keys published files may leave out.
_DEFAULTS = {
    "vocab_size": 262144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 0,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
}
_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's global_head_dim when neither it nor overrides are set


# Per-layer inputs (E2B, E4B): the model's table, projection and norm, each layer's gate.
PER_LAYER_ROWS = list(
    rows(
        ("model.embed_tokens_per_layer.weight", "per_layer.embed.weight"),
        ("model.per_layer_model_projection.weight", "per_layer.project.weight"),
        ("model.per_layer_projection_norm.weight", "per_layer.norm.weight"),
        ("model.layers.{i}.per_layer_input_gate.weight", "blocks.per_layer.gate.weight"),
        ("model.layers.{i}.per_layer_projection.weight", "blocks.per_layer.out.weight"),
        ("model.layers.{i}.post_per_layer_input_norm.weight", "blocks.per_layer.norm.weight"),
    )
)


def _table(body: str) -> tuple:
    """The key table with the language model under `body` ("model." for Gemma4ForCausalLM,
    "model.language_model." in the published multimodal files); the head is tied."""
    scalar = rows(("model.layers.{i}.layer_scalar", "blocks.layer_scalar"))
    local = [r for r in SANDWICH_TABLE + QK_NORM_ROWS + scalar if r.hf != "lm_head.weight"]
    local = with_experts(local)  # 26B-A4B's dense MLP beside its experts
    local += PER_LAYER_ROWS
    # The global layers' own stack (attention.global_shape) and the kv-shared layers' stacks
    # have the same tensor names (a shared layer has no k_proj, v_proj or k_norm).
    others = [
        dataclasses.replace(r, eqllm=tuple(stack + p for p in r.eqllm))
        for stack in ("global_", "shared_", "shared_global_")
        for r in local
        if r.layered
    ]
    return tuple(
        dataclasses.replace(r, hf=body + r.hf.removeprefix("model.")) for r in local + others
    )


TABLE = _table("model.")
MULTIMODAL_TABLE = _table("model.language_model.")


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    p = cfg.positions
    full = {"rope_type": "default", "rope_theta": p.theta}
    if p.global_fraction is not None:
        full = {**full, "rope_type": "proportional", "partial_rotary_factor": p.global_fraction}
    return {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": p.local_theta},
    }


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    a = cfg.attention
    fields = {k: v for k, v in llama_to_hf(cfg).items() if k not in ("rope_theta", "rope_scaling")}
    return {
        **fields,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "sliding_window": a.sliding_window,
        "layer_types": layer_types(cfg),
        "final_logit_softcapping": cfg.final_softcap,
        "rope_parameters": _rope_to_hf(cfg),
        "global_head_dim": a.global_head_dim or cfg.head_dim,
        "num_global_key_value_heads": a.global_kv_heads or a.n_kv_heads,
        "attention_k_eq_v": a.k_eq_v,
        "hidden_size_per_layer_input": 0 if cfg.per_layer is None else cfg.per_layer.d,
        "vocab_size_per_layer_input": (cfg.per_layer and cfg.per_layer.vocab_size)
        or cfg.vocab_size,
        "num_kv_shared_layers": a.kv_shared_layers or 0,
        "use_double_wide_mlp": cfg.mlp.kv_shared_d_ff is not None,
        "tie_word_embeddings": True,
        **experts_to_hf(cfg),
    }


def _unsupported(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"config.json {key}={value!r} is not supported for Gemma 4 yet; {fix}")


def _global_shape(hf: dict[str, Any], head_dim: int, kv_heads: int) -> dict[str, Any]:
    """The global layers' head size and kv heads where they differ from the local layers'
    (None where the same): from `per_layer_config` as transformers saves it, or from
    `global_head_dim` (512 when absent) and, with keys as values, `num_global_key_value_heads`,
    as the published files give them."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        shape = {"head_dim": hf.get("global_head_dim", _GLOBAL_HEAD_DIM)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            shape["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {"full_attention": shape}
    shapes = {(v.get("head_dim", head_dim), v.get("num_key_value_heads", kv_heads))
              for v in overrides.values()}  # fmt: skip
    if len(shapes) > 1:
        raise _unsupported(
            "per_layer_config", overrides, "eqllm's global layers all have one shape"
        )
    global_head, global_kv = shapes.pop() if shapes else (head_dim, kv_heads)
    return {
        "attention.global_head_dim": None if global_head == head_dim else global_head,
        "attention.global_kv_heads": None if global_kv == kv_heads else global_kv,
    }


# transformers' rope_parameters when a config.json has none.
_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}  # fmt: skip


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The global and local RoPE bases and the global layers' proportion (the local layers
    rotate their whole heads)."""
    params = hf.get("rope_parameters") or _ROPE
    full, local = (dict(params.get(k) or {}) for k in ("full_attention", "sliding_attention"))
    for kind, p, allowed in (
        ("full_attention", full, ("default", "proportional")),
        ("sliding_attention", local, ("default",)),
    ):
        if p.get("rope_type", "default") not in allowed or set(p) - {
            "rope_type", "rope_theta", "partial_rotary_factor"
        }:  # fmt: skip
            raise _unsupported(f"rope_parameters.{kind}", p, f"eqllm reads rope_type {allowed}")
    if local.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(
            "rope_parameters.sliding_attention", local, "the local layers rotate whole heads"
        )
    fraction = full.get("partial_rotary_factor", 1.0)
    if full.get("rope_type", "default") == "default" and fraction != 1.0:
        raise _unsupported(
            "rope_parameters.full_attention", full, "partial rotation is read as 'proportional'"
        )
    return {
        "positions.theta": float(full.get("rope_theta", 1_000_000.0)),
        "positions.local_theta": float(local.get("rope_theta", 10_000.0)),
        "positions.global_fraction": None if fraction == 1.0 else float(fraction),
    }


def _per_layer(hf: dict[str, Any], vocab_size: int, d_ff: int) -> dict[str, Any]:
    """E2B/E4B's per-layer inputs and kv-shared layers (with their double-wide MLP), where the
    file (or transformers' default, 256 per-layer numbers over 262,144 rows) has them."""
    d = hf.get("hidden_size_per_layer_input", _DEFAULTS["hidden_size_per_layer_input"])
    rows_ = hf.get("vocab_size_per_layer_input", 262_144)
    shared = hf.get("num_kv_shared_layers") or None
    wide = bool(hf.get("use_double_wide_mlp")) and shared is not None
    return {
        "per_layer": {"d": d, "vocab_size": None if rows_ == vocab_size else rows_} if d else None,
        "attention.kv_shared_layers": shared,
        "mlp.kv_shared_d_ff": 2 * d_ff if wide else None,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_activation", GELU_TANH)
    refuse(hf, "hidden_act", (*GELU_TANH, None))
    refuse(hf, "attention_bias", (False,))
    refuse(hf, "tie_word_embeddings", (True,))
    # Text tokens attend causally under "vision"; "all" makes every token bidirectional.
    refuse(hf, "use_bidirectional_attention", (None, "vision"))
    fields = llama_from_hf({k: v for k, v in hf.items() if k != "rope_parameters"})
    every = global_every(hf, 6)
    if fields["n_layers"] % every:  # transformers makes the last layer global whatever the list
        raise _unsupported(
            "num_hidden_layers",
            fields["n_layers"],
            f"eqllm needs a whole number of local/global groups of {every} layers",
        )
    fields.pop("positions.scaling", None)
    return {
        **fields,
        **_rope(hf),
        **_global_shape(hf, fields["attention.head_dim"], fields["attention.n_kv_heads"]),
        **_per_layer(hf, fields["vocab_size"], fields["mlp.d_ff"]),
        "attention.k_eq_v": bool(hf.get("attention_k_eq_v", False)),
        "attention.sliding_window": need(hf, "sliding_window"),
        "attention.global_every": every,
        "final_softcap": hf.get("final_logit_softcapping"),
        **experts_from_hf(hf),
    }


def _check(cfg: ModelConfig) -> dict[str, Any]:
    if bad := check_experts(cfg):
        return bad
    a = cfg.attention
    for k in ("attention.sliding_window", "attention.global_every", "positions.local_theta"):
        if cfg.at(k) is None:
            return {k: None}
    if cfg.n_layers % a.global_every:
        return {"n_layers": cfg.n_layers}
    # Written as the local layers' own sizes, read back as None; transformers reads the global
    # kv heads only where keys are values.
    if a.global_head_dim == cfg.head_dim:
        return {"attention.global_head_dim": a.global_head_dim}
    if a.global_kv_heads is not None and (a.global_kv_heads == a.n_kv_heads or not a.k_eq_v):
        return {"attention.global_kv_heads": a.global_kv_heads}
    if cfg.mlp.kv_shared_d_ff not in (None, 2 * cfg.mlp.d_ff):  # transformers doubles it
        return {"mlp.kv_shared_d_ff": cfg.mlp.kv_shared_d_ff}
    return {}


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """What llama.cpp's gemma4 cannot hold: a per-layer table of other rows than the vocabulary's
    (it looks them up by token id), and a fraction of the global layers' frequencies that is not
    a whole number of them (`rope_freqs` turns each or not; read back, the fraction would be
    the whole number's)."""
    wrong: dict[str, Any] = {}
    if cfg.per_layer is not None and cfg.per_layer.vocab_size is not None:
        wrong["per_layer.vocab_size"] = cfg.per_layer.vocab_size
    fraction, head = cfg.positions.global_fraction, cfg.attention.global_head_dim or cfg.head_dim
    if fraction is not None and (fraction * head / 2) % 1:
        wrong["positions.global_fraction"] = fraction
    return wrong


FAMILY = Family(
    name="gemma4",
    released="2026-04",
    architecture="Gemma4ForCausalLM",
    model_type="gemma4_text",
    fixed={  # moe: None, or 26B-A4B's experts (`_gemma4_moe.EXPERTS`, checked by `_check`)
        "norms.kind": "rmsnorm",
        "norms.plus_one": False,
        "norms.pre": True,
        "norms.post": True,
        "norms.layer_scalar": True,
        "mlp.kind": "geglu",
        "mlp.bias": False,
        "positions.kind": "rope",
        "positions.fraction": 1.0,
        "positions.scaling": None,
        "positions.nope_every": None,
        "attention.kind": "gqa",
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "attention.qk_norm": "head",
        "attention.v_norm": True,
        "attention.query_pre_attn_scalar": 1,
        "attention.softcap": None,
        "attention.sinks": False,
        "attention.output_gate": False,
        "attention.chunk_size": None,
        "attention.rope_interleave": False,
        "attention.temperature_floor": None,
        "embed_scale": True,
        "tie_embeddings": True,
        "parallel_residual": False,
        "linear": None,
        "multipliers": None,
    },
    table=TABLE,
    layouts=(MULTIMODAL_TABLE,),
    prefix="model.",
    hf_keys=LLAMA_KEYS
    | {
        "hidden_activation",
        "attention_bias",
        "use_bidirectional_attention",
        "sliding_window",
        "layer_types",
        "final_logit_softcapping",
        "global_head_dim",
        "num_global_key_value_heads",
        "per_layer_config",
        "attention_k_eq_v",
        "hidden_size_per_layer_input",
        "vocab_size_per_layer_input",
        "num_kv_shared_layers",
        "use_double_wide_mlp",
        "enable_moe_block",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
        "expert_intermediate_size",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=_check,
    defaults=_DEFAULTS,
    wrapper="gemma4",
    gguf="gemma4",
    gguf_refuses=gguf_refuses,
    ignored=r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",
)
