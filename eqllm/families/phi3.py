"""Phi-3 (Abdin et al., 2024, "Phi-3 Technical Report"): the Llama block with the q/k/v and the
gate/up projections each stored as one fused matrix, an optional partial rotary embedding
(`partial_rotary_factor`) and an optional sliding window over every layer."""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._rope import rope_params
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    Family,
    llama_from_hf,
    llama_to_hf,
    refuse,
    rows,
    token_ids,
)

# Fused rows: split along the output axis on import, concatenated on export, in this order
# (transformers slices qkv_proj as q | k | v and chunks gate_up_proj as gate | up).
TABLE = rows(
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.attn_norm.weight"),
    (
        "model.layers.{i}.self_attn.qkv_proj.weight",
        ["blocks.attn.q_proj.weight", "blocks.attn.k_proj.weight", "blocks.attn.v_proj.weight"],
    ),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
    (
        "model.layers.{i}.mlp.gate_up_proj.weight",
        ["blocks.mlp.gate.weight", "blocks.mlp.up.weight"],
    ),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.mlp.down.weight"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)


_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}  # Phi3Config's


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    scaling = cfg.positions.scaling
    return {
        **token_ids(cfg, _TOKEN_IDS),
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "partial_rotary_factor": cfg.positions.fraction,
        "sliding_window": cfg.attention.sliding_window,
        "original_max_position_embeddings": (
            cfg.max_seq_len if scaling is None else scaling.original_max_seq_len
        ),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


# Phi-4-mini's config.json carries settings of its release's remote code, which transformers'
# Phi3 does not read; at these values both compute the same model (no MLP or head biases,
# every layer full attention, no interpolation).
_REMOTE_CODE = {
    "mlp_bias": False,
    "lm_head_bias": False,
    "full_attn_mod": 1,
    "interpolate_factor": 1,
}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "attention_bias", (False,))
    for key, plain in _REMOTE_CODE.items():
        refuse(hf, key, (plain,))
    # transformers 5 repeats partial_rotary_factor inside rope_parameters; the older layout
    # has it at the top level only.
    rope = dict(hf.get("rope_parameters") or {})
    fraction = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    scaling = dict(hf.get("rope_scaling") or {})
    for layout in (rope, scaling):  # Phi3Config reads the releases' "su" and "yarn" as LongRoPE
        for key in ("rope_type", "type"):
            if layout.get(key) in ("su", "yarn"):
                layout[key] = "longrope"
    if rope_params({"rope_parameters": rope, "rope_scaling": scaling})["rope_type"] not in (
        "default",
        "longrope",
    ):
        raise ConfigError(
            f"rope scaling {scaling or rope} in config.json is not supported for Phi-3; "
            "transformers' Phi3 applies 'longrope' only"
        )
    fields = llama_from_hf(
        {**hf, "rope_parameters": rope, "rope_scaling": scaling or None}, eps=1e-5
    )
    return {
        **fields,
        "positions.fraction": float(fraction),
        "attention.sliding_window": hf.get("sliding_window"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


FAMILY = Family(
    name="phi3",
    released="2024-04",
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "positions.fraction"},
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "mlp.bias": False,
    },
    table=TABLE,
    prefix=LLAMA_PREFIX,
    # original_max_position_embeddings is LongRoPE's original context (with default RoPE it only
    # echoes the context); the dropouts do nothing at inference; auto_map names the
    # release's remote code, which transformers runs only when trusted (its own Phi3 otherwise).
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "auto_map",
        "partial_rotary_factor",
        "sliding_window",
        "original_max_position_embeddings",
        "resid_pdrop",
        "embd_pdrop",
        *_REMOTE_CODE,
    },
    to_hf=to_hf,
    from_hf=from_hf,
    check=lambda cfg: (
        {"positions.scaling.kind": cfg.positions.scaling.kind}
        if cfg.positions.scaling is not None and cfg.positions.scaling.kind != "longrope"
        else {}
    ),
)
