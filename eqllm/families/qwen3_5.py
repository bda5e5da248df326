"""Qwen3.5, dense text model (Qwen Team, 2026): a hybrid stack of three Gated DeltaNet layers
(linear attention; Yang, Kautz & Hatamizadeh, 2025) to one gated softmax attention layer.

The attention layers are Qwen3's with an output gate (q_proj emits each head's query and gate
side by side), a quarter of each head rotated, and QK-norm; every RMSNorm scales by (1 + w)
except the Gated DeltaNet's own gated output norm, which scales by w. Published checkpoints are
vision-language models (`qwen3_5`, `Qwen3_5ForConditionalGeneration`): eqllm reads their
language model (`text_config`, `model.language_model.*`) and leaves the vision tower out.
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._rope import rope_from_hf
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    Family,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
    rows,
)


def _table(body: str) -> tuple:
    """The key table with the language model's tensors under `body` ("model." for
    Qwen3_5ForCausalLM, "model.language_model." for the published vision-language files)."""
    layer = body + "layers.{i}."
    both = [
        (f"{layer}input_layernorm.weight", "attn_norm.weight"),
        (f"{layer}post_attention_layernorm.weight", "mlp_norm.weight"),
        (f"{layer}mlp.gate_proj.weight", "mlp.gate.weight"),
        (f"{layer}mlp.up_proj.weight", "mlp.up.weight"),
        (f"{layer}mlp.down_proj.weight", "mlp.down.weight"),
    ]
    full = [(hf, f"blocks.{p}") for hf, p in both] + [
        (f"{layer}self_attn.k_proj.weight", "blocks.attn.k_proj.weight"),
        (f"{layer}self_attn.v_proj.weight", "blocks.attn.v_proj.weight"),
        (f"{layer}self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
        (f"{layer}self_attn.q_norm.weight", "blocks.attn.q_norm.weight"),
        (f"{layer}self_attn.k_norm.weight", "blocks.attn.k_norm.weight"),
    ]
    gdn = f"{layer}linear_attn."
    linear = [(hf, f"linear_blocks.{p}") for hf, p in both] + [
        (f"{gdn}in_proj_z.weight", "linear_blocks.attn.z_proj.weight"),
        (f"{gdn}in_proj_b.weight", "linear_blocks.attn.b_proj.weight"),
        (f"{gdn}in_proj_a.weight", "linear_blocks.attn.a_proj.weight"),
        (f"{gdn}out_proj.weight", "linear_blocks.attn.out_proj.weight"),
        (f"{gdn}dt_bias", "linear_blocks.attn.dt_bias"),
        (f"{gdn}A_log", "linear_blocks.attn.A_log"),
        (f"{gdn}norm.weight", "linear_blocks.attn.norm.weight"),
    ]
    return (
        *rows((f"{body}embed_tokens.weight", "embed.weight"), *full, *linear),
        # Each head's query, then its gate: q_proj's rows viewed as [heads, 2, head_dim].
        *rows(
            (
                f"{layer}self_attn.q_proj.weight",
                ("blocks.attn.q_proj.weight", "blocks.attn.gate_proj.weight"),
            ),
            per_head=True,
        ),
        *rows(
            (
                f"{gdn}in_proj_qkv.weight",
                tuple(f"linear_blocks.attn.{p}_proj.weight" for p in "qkv"),
            )
        ),
        *rows((f"{gdn}conv1d.weight", "linear_blocks.attn.conv_weight"), depthwise=True),
        *rows((f"{body}norm.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")),
    )


TABLE = _table(LLAMA_PREFIX)
VISION_LANGUAGE_TABLE = _table("model.language_model.")


def _layer_types(cfg: ModelConfig) -> list[str]:
    return [f"{kind}_attention" for kind in cfg.layer_kinds()]


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    lin = cfg.linear
    hf = {k: v for k, v in llama_to_hf(cfg).items() if k not in ("rope_theta", "rope_scaling")}
    return {
        **hf,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": _layer_types(cfg),
        "linear_conv_kernel_dim": lin.conv_kernel,
        "linear_key_head_dim": lin.key_head_dim,
        "linear_value_head_dim": lin.value_head_dim,
        "linear_num_key_heads": lin.n_key_heads,
        "linear_num_value_heads": lin.n_value_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.positions.theta,
            "partial_rotary_factor": cfg.positions.fraction,
        },
    }


# Keys of the published files that transformers' Qwen3_5TextConfig does not read, accepted at
# the values with which both compute this model: the attention's output gate (always on in
# transformers), the recurrent state's dtype (eqllm keeps it in fp32) and no MLP-only layers.
_PUBLISHED = {"attn_output_gate": True, "mamba_ssm_dtype": "float32", "mlp_only_layers": []}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "attention_bias", (False,))
    for key, plain in _PUBLISHED.items():
        refuse(hf, key, (plain,))
    n_layers = need(hf, "num_hidden_layers")
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)
    ]
    if "full_attention" in types:
        every = types.index("full_attention") + 1
    expected = [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)
    ]
    if types != expected or n_layers % every:
        raise ConfigError(
            f"config.json layer_types={types} is not whole groups of linear_attention layers "
            "each closed by one full_attention layer, the only pattern eqllm's Qwen3.5 reads"
        )
    # Multimodal RoPE (mrope_section) gives a text token the same position on each of its
    # three axes, where it equals plain RoPE; eqllm reads text only.
    rope = {
        k: v
        for k, v in (hf.get("rope_parameters") or {}).items()
        if k not in ("mrope_section", "mrope_interleaved")
    }
    fraction = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    rope_hf = {**hf, "rope_parameters": rope}
    return {
        **llama_from_hf({**hf, "rope_parameters": None}),
        **rope_from_hf(rope_hf, allowed=("default",)),
        "positions.fraction": float(fraction),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "linear": {
            "full_every": every,
            "n_key_heads": hf.get("linear_num_key_heads", 16),
            "n_value_heads": hf.get("linear_num_value_heads", 32),
            "key_head_dim": hf.get("linear_key_head_dim", 128),
            "value_head_dim": hf.get("linear_value_head_dim", 128),
            "conv_kernel": hf.get("linear_conv_kernel_dim", 4),
        },
    }


FAMILY = Family(
    name="qwen3_5",
    released="2026-02",
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("positions.fraction", "linear")},
        "linear.kind": "gated_deltanet",
        "norms.plus_one": True,
        "attention.qk_norm": "head",
        "attention.output_gate": True,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "attention.sliding_window": None,
        "mlp.bias": False,
    },
    table=TABLE,
    layouts=(VISION_LANGUAGE_TABLE,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | set(_PUBLISHED)
    | {
        "attention_bias",
        "layer_types",
        "full_attention_interval",
        "partial_rotary_factor",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "mtp_num_hidden_layers",
        "mtp_use_dedicated_embeddings",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    wrapper="qwen3_5",
    ignored=r"^(mtp\.|model\.visual\.)",
)
