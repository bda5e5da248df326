"""Llama 4 (Meta, 2025, "The Llama 4 herd"), text model: grouped-query attention whose rotary
layers attend within chunks of `attention_chunk_size` positions with their queries and keys
L2-normalised (a weightless RMSNorm, `use_qk_norm`) and whose every fourth layer is global,
without rotary positions (NoPE) and with attention-temperature tuning of its queries
(`attn_temperature_tuning`, `floor_scale`, `attn_scale`); Llama's complex rotation pairs
adjacent dims (`attention.rope_interleave`). Every `interleave_moe_layer_step`-th layer is a
mixture of experts (`moe.sparse_every`): top-1 sigmoid routing that scales the expert's input by
the router score, plus an ungated shared expert as wide as a routed one (`intermediate_size`);
the layers between them (Maverick's, step 2; Scout, step 1, has none) have a dense SwiGLU MLP of
`intermediate_size_mlp`, a stack of their own (`dense_blocks`, layer kind "dense").

Published checkpoints are vision-language models (`llama4`, `Llama4ForConditionalGeneration`):
eqllm reads their language model (`text_config`, `language_model.*`) and leaves the vision tower
and the multimodal projector out.
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.experts import PLAIN_ROUTER
from eqllm.families._moe import moe_from_hf, moe_to_hf
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
from eqllm.families.smollm3 import nope_every

_INTERVAL = 4  # Llama4TextConfig's no_rope_layer_interval


def _table(body: str, head: str) -> tuple:
    """The key table with the language model under `body` ("model." for Llama4ForCausalLM,
    "language_model.model." in the published vision-language files) and the head at `head`."""
    layer = body + "layers.{i}."
    ff = layer + "feed_forward."
    plain = [
        (f"{body}embed_tokens.weight", "embed.weight"),
        (f"{layer}input_layernorm.weight", "blocks.attn_norm.weight"),
        (f"{layer}post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
        (f"{ff}router.weight", "blocks.mlp.router.weight"),
        (f"{ff}shared_expert.gate_proj.weight", "blocks.mlp.shared.gate.weight"),
        (f"{ff}shared_expert.up_proj.weight", "blocks.mlp.shared.up.weight"),
        (f"{ff}shared_expert.down_proj.weight", "blocks.mlp.shared.down.weight"),
        (f"{body}norm.weight", "final_norm.weight"),
        (head, "lm_head.weight"),
    ]
    for p in ("q", "k", "v", "o"):
        for kind in ("weight", "bias"):
            plain.append((f"{layer}self_attn.{p}_proj.{kind}", f"blocks.attn.{p}_proj.{kind}"))
    # The experts are stored as x @ W: gate_up_proj [E, d_model, 2 d_ff] (gate columns, then
    # up) and down_proj [E, d_ff, d_model].
    experts = rows(
        (f"{ff}experts.gate_up_proj", ("blocks.mlp.gate.weight", "blocks.mlp.up.weight")),
        axis=1,
        transposed=True,
    ) + rows((f"{ff}experts.down_proj", "blocks.mlp.down.weight"), transposed=True)
    # Maverick's dense layers: the same attention and norms, and a SwiGLU MLP.
    dense = [
        (hf, "dense_blocks." + ours.removeprefix("blocks."))
        for hf, ours in plain
        if hf.startswith(layer) and not hf.startswith(ff)
    ]
    dense += [
        (f"{ff}{p}_proj.weight", f"dense_blocks.mlp.{p}.weight") for p in ("gate", "up", "down")
    ]
    return rows(*plain) + experts + rows(*dense)


TABLE = _table(LLAMA_PREFIX, "lm_head.weight")
VISION_LANGUAGE_TABLE = _table("language_model.model.", "language_model.lm_head.weight")
# Llama4TextConfig's defaults, for keys a config.json leaves out.
_DEFAULTS = {
    "rope_theta": 500000.0,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": _INTERVAL,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "router_aux_loss_coef": 0.001,
    "rms_norm_eps": 1e-5,
}


def _layer_types(cfg: ModelConfig) -> list[str]:
    return ["chunked_attention" if w else "full_attention" for w in cfg.local_layers()]


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    a, moe = cfg.attention, cfg.moe
    tuning = a.temperature_floor is not None
    return {
        **llama_to_hf(cfg),
        **moe_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": a.qkv_bias,
        "intermediate_size": cfg.expert_d_ff,
        "intermediate_size_mlp": cfg.mlp.d_ff,
        "num_local_experts": moe.n_experts,
        "interleave_moe_layer_step": moe.sparse_every,
        "moe_layers": [i for i, kind in enumerate(cfg.layer_kinds()) if kind == "full"],
        "use_qk_norm": a.qk_norm == "l2",
        "no_rope_layers": [int(r) for r in cfg.rotary_layers()],
        "no_rope_layer_interval": cfg.positions.nope_every or _INTERVAL,
        "attention_chunk_size": a.chunk_size,
        "layer_types": _layer_types(cfg),
        "attn_temperature_tuning": tuning,
        "floor_scale": a.temperature_floor if tuning else _DEFAULTS["floor_scale"],
        "attn_scale": a.temperature_scale if tuning else _DEFAULTS["attn_scale"],
        "router_jitter_noise": 0.0,
    }


def _expert_layers(hf: dict[str, Any], n_layers: int) -> int:
    """The step of the expert layers (`moe.sparse_every`): moe_layers must be every step-th
    layer, counting from 1 (transformers' default list for interleave_moe_layer_step)."""
    step = hf["interleave_moe_layer_step"]
    layers = hf.get("moe_layers")
    if layers is None:
        layers = list(range(step - 1, n_layers, step))
    if not layers:
        raise ConfigError(
            f"config.json moe_layers={list(layers)} has no expert layer; a llama4 model has "
            "experts in every interleave_moe_layer_step-th layer"
        )
    every = layers[0] + 1
    if list(layers) != list(range(every - 1, n_layers, every)):
        raise ConfigError(
            f"config.json moe_layers={list(layers)} is not supported: eqllm's llama4 has experts "
            "in every k-th layer (range(k - 1, num_hidden_layers, k)), as "
            "interleave_moe_layer_step builds them; list such layers"
        )
    return every


def _floor_scale(value: Any) -> int:
    if float(value) != int(value) or int(value) <= 0:
        raise ConfigError(f"config.json floor_scale={value!r} must be a positive whole number")
    return int(value)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "router_jitter_noise", (0.0, 0, None))
    refuse(hf, "for_llm_compressor", (False, None))
    n_layers = need(hf, "num_hidden_layers")
    every = _expert_layers(hf, n_layers)
    rotary = hf.get("no_rope_layers") or [
        int((i + 1) % (hf["no_rope_layer_interval"] or _INTERVAL) != 0) for i in range(n_layers)
    ]
    if len(rotary) < n_layers:
        raise ConfigError(
            f"config.json no_rope_layers has {len(rotary)} entries for num_hidden_layers="
            f"{n_layers}; it needs one per layer"
        )
    rotary = list(rotary[:n_layers])
    nope = nope_every(rotary)
    chunk = hf.get("attention_chunk_size")
    expected = [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rotary
    ]
    if hf.get("layer_types") and list(hf["layer_types"]) != expected:
        raise ConfigError(
            f"config.json layer_types={hf['layer_types']} is not supported; eqllm's llama4 has "
            "chunked attention exactly in the rotary layers (no_rope_layers), as transformers "
            "builds it"
        )
    tuning = bool(hf["attn_temperature_tuning"])
    d_ff = need(hf, "intermediate_size")
    return {
        **llama_from_hf({**hf, "intermediate_size": hf["intermediate_size_mlp"]}, eps=1e-5),
        **attention_bias_from_hf(hf),
        **moe_from_hf(hf, {}),
        "positions.nope_every": nope,
        "attention.chunk_size": chunk,
        "attention.global_every": nope if chunk is not None else None,
        "attention.qk_norm": "l2" if hf["use_qk_norm"] else None,
        "attention.temperature_floor": _floor_scale(hf["floor_scale"]) if tuning else None,
        "attention.temperature_scale": float(hf["attn_scale"]) if tuning else None,
        "moe.n_experts": need(hf, "num_local_experts"),
        "moe.d_ff": d_ff,
        "moe.shared_d_ff": d_ff,
        "moe.sparse_every": every,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


# What the Llama block fixes and config.json sets here.
_READ = (
    "moe",
    "attention.qk_norm",
    "attention.chunk_size",
    "attention.global_every",
    "attention.temperature_floor",
    "attention.rope_interleave",
    "positions.nope_every",
)


def _check(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.moe is None:
        return {"moe": None}
    a = cfg.attention
    if a.qk_norm not in (None, "l2"):
        return {"attention.qk_norm": a.qk_norm}
    if cfg.moe.shared_d_ff != cfg.expert_d_ff:  # one intermediate_size for both
        return {"moe.shared_d_ff": cfg.moe.shared_d_ff}
    if a.chunk_size is not None and cfg.local_layers() != cfg.rotary_layers():
        return {"attention.global_every": a.global_every}  # chunked exactly where rotary
    if a.chunk_size is None and a.global_every is not None:
        return {"attention.global_every": a.global_every}
    return one_attention_bias(cfg)


# What llama.cpp's llama4 fixes and a GGUF file does not hold (llama_model_llama4::
# load_arch_hparams): chunks of 8192 positions on three of every four layers, the fourth global
# and NoPE with temperature tuning; and L2 QK-norm exactly when there are not 128 experts.
GGUF_FIXED = {
    "attention.chunk_size": 8192,
    "attention.global_every": 4,
    "positions.nope_every": 4,
    "attention.temperature_floor": 8192,
    "attention.temperature_scale": 0.1,
}
GGUF_UNNORMED_EXPERTS = 128


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """The settings llama.cpp's llama4 fixes otherwise (`GGUF_FIXED`), QK-norm other than its
    rule, and attention biases (not read)."""
    wrong = {k: cfg.at(k) for k, v in GGUF_FIXED.items() if cfg.at(k) != v}
    a, n_experts = cfg.attention, cfg.at("moe.n_experts")
    if (a.qk_norm == "l2") != (n_experts != GGUF_UNNORMED_EXPERTS):
        wrong["attention.qk_norm"] = a.qk_norm
    return {**wrong, **({"attention.qkv_bias": True} if a.qkv_bias else {})}


FAMILY = Family(
    name="llama4",
    released="2025-04",
    architecture="Llama4ForCausalLM",
    model_type="llama4_text",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in _READ},
        "attention.rope_interleave": True,
        "attention.sliding_window": None,
        "mlp.bias": False,
        "moe.bias": False,
        "moe.activation": "swiglu",
        "moe.scoring": "sigmoid",
        "moe.score_bias": False,
        "moe.n_groups": None,
        "moe.routed_scale": 1.0,
        "moe.dense_layers": 0,
        "moe.norm_topk_prob": False,
        "moe.shared_gated": False,
        "moe.score_input": True,
        **PLAIN_ROUTER,
    },
    table=TABLE,
    layouts=(VISION_LANGUAGE_TABLE,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "intermediate_size_mlp",
        "num_local_experts",
        "num_experts_per_tok",
        "interleave_moe_layer_step",
        "moe_layers",
        "use_qk_norm",
        "no_rope_layers",
        "no_rope_layer_interval",
        "attention_chunk_size",
        "layer_types",
        "attn_temperature_tuning",
        "floor_scale",
        "attn_scale",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "output_router_logits",
        "for_llm_compressor",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=_check,
    defaults=_DEFAULTS,
    wrapper="llama4",
    ignored=r"^(vision_model\.|multi_modal_projector\.)",
    gguf="llama4",
    gguf_refuses=gguf_refuses,
)
