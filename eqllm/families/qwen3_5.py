"""Qwen3.5, dense text model (Qwen Team, 2026): a hybrid stack of three Gated DeltaNet layers
(linear attention; Yang, Kautz & Hatamizadeh, 2025) to one gated softmax attention layer.

The attention layers are Qwen3's with an output gate (q_proj emits each head's query and gate
side by side), a quarter of each head rotated, and QK-norm; every RMSNorm scales by (1 + w)
except the Gated DeltaNet's own gated output norm, which scales by w. Published checkpoints are
vision-language models (`qwen3_5`, `Qwen3_5ForConditionalGeneration`): eqllm reads their
language model (`text_config`, `model.language_model.*`) and leaves the vision tower out.

The published files repeat three linear layers and one attention layer; config.json's
`layer_types` reads in any order of the two (`eqllm.families._hybrid`) and is written back as
it was.

The hybrid's key table and config translation (`hybrid_table`, `hybrid_to_hf`,
`hybrid_from_hf`) take the MLP's rows and the Gated DeltaNet's projection rows as arguments:
Qwen3.5-MoE and Qwen3-Next (`qwen3_5_moe`, `qwen3_next`) reuse them with their experts.
"""

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families._hybrid import from_layer_types, to_layer_types
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


def dense_mlp(layer: str, stack: str) -> tuple:
    """The SwiGLU MLP rows of one stack's layers (`layer`: "model.layers.{i}.")."""
    return rows(
        *(
            (f"{layer}mlp.{p}_proj.weight", f"{stack}.mlp.{p}.weight")
            for p in ("gate", "up", "down")
        )
    )


def gdn_projections(gdn: str) -> tuple:
    """Qwen3.5's Gated DeltaNet input projections (`gdn`: "model.layers.{i}.linear_attn."):
    q, k and v fused in that order, then z, b and a on their own."""
    ours = "linear_blocks.attn."
    return (
        *rows(
            (f"{gdn}in_proj_z.weight", f"{ours}z_proj.weight"),
            (f"{gdn}in_proj_b.weight", f"{ours}b_proj.weight"),
            (f"{gdn}in_proj_a.weight", f"{ours}a_proj.weight"),
        ),
        *rows((f"{gdn}in_proj_qkv.weight", tuple(f"{ours}{p}_proj.weight" for p in "qkv"))),
    )


def hybrid_table(body: str, mlp=dense_mlp, projections=gdn_projections) -> tuple:
    """The key table of a Qwen3.5-style hybrid with the language model's tensors under `body`
    ("model." for *ForCausalLM, "model.language_model." for the published vision-language
    files). `mlp(layer, stack)`: the MLP's rows of a stack ("blocks" or "linear_blocks");
    `projections(gdn)`: the Gated DeltaNet's input projection rows (Qwen3.5's or Qwen3-Next's)."""
    layer = body + "layers.{i}."

    def norms(stack: str) -> list[tuple[str, str]]:
        return [
            (f"{layer}input_layernorm.weight", f"{stack}.attn_norm.weight"),
            (f"{layer}post_attention_layernorm.weight", f"{stack}.mlp_norm.weight"),
        ]

    full = [
        (f"{layer}self_attn.k_proj.weight", "blocks.attn.k_proj.weight"),
        (f"{layer}self_attn.v_proj.weight", "blocks.attn.v_proj.weight"),
        (f"{layer}self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
        (f"{layer}self_attn.q_norm.weight", "blocks.attn.q_norm.weight"),
        (f"{layer}self_attn.k_norm.weight", "blocks.attn.k_norm.weight"),
    ]
    gdn = f"{layer}linear_attn."
    linear = [
        (f"{gdn}out_proj.weight", "linear_blocks.attn.out_proj.weight"),
        (f"{gdn}dt_bias", "linear_blocks.attn.dt_bias"),
        (f"{gdn}A_log", "linear_blocks.attn.A_log"),
        (f"{gdn}norm.weight", "linear_blocks.attn.norm.weight"),
    ]
    return (
        *rows((f"{body}embed_tokens.weight", "embed.weight"), *norms("blocks"), *full),
        *rows(*norms("linear_blocks"), *linear),
        *mlp(layer, "blocks"),
        *mlp(layer, "linear_blocks"),
        # Each head's query, then its gate: q_proj's rows viewed as [heads, 2, head_dim].
        *rows(
            (
                f"{layer}self_attn.q_proj.weight",
                ("blocks.attn.q_proj.weight", "blocks.attn.gate_proj.weight"),
            ),
            per_head=True,
        ),
        *projections(gdn),
        *rows((f"{gdn}conv1d.weight", "linear_blocks.attn.conv_weight"), depthwise=True),
        *rows((f"{body}norm.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")),
    )


TABLE = hybrid_table(LLAMA_PREFIX)
VISION_LANGUAGE_TABLE = hybrid_table("model.language_model.")


def hybrid_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Qwen3.5-style hybrid: Llama's, without the MLP size, the
    layer pattern, the Gated DeltaNet's sizes and partial rotary in `rope_parameters`."""
    lin = cfg.linear
    drop = ("rope_theta", "rope_scaling", "intermediate_size")
    hf = {k: v for k, v in llama_to_hf(cfg).items() if k not in drop}
    return {
        **hf,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": to_layer_types(cfg),
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


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**hybrid_to_hf(cfg), "intermediate_size": cfg.mlp.d_ff}


# Keys of the published files that transformers' Qwen3_5TextConfig does not read, accepted at
# the values with which both compute this model: the attention's output gate (always on in
# transformers), the recurrent state's dtype (eqllm keeps it in fp32) and no MLP-only layers.
PUBLISHED = {"attn_output_gate": True, "mamba_ssm_dtype": "float32", "mlp_only_layers": []}


def hybrid_from_hf(hf: dict[str, Any], published: dict[str, Any] = PUBLISHED) -> dict[str, Any]:
    """ModelConfig settings of a Qwen3.5-style hybrid's config.json: Llama's (the MLP size
    from `intermediate_size`), the layer pattern, partial rotary and the Gated DeltaNet's sizes
    (transformers' defaults where a file leaves them out). `published`: keys transformers
    does not read, accepted only at the value with which both compute the same model."""
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "attention_bias", (False,))
    for key, plain in published.items():
        refuse(hf, key, (plain,))
    n_layers = need(hf, "num_hidden_layers")
    every = hf.get("full_attention_interval", 4)  # transformers' default, without layer_types
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)
    ]
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
            **from_layer_types(types, n_layers, "Qwen3.5-style hybrid"),
            "n_key_heads": hf.get("linear_num_key_heads", 16),
            "n_value_heads": hf.get("linear_num_value_heads", 32),
            "key_head_dim": hf.get("linear_key_head_dim", 128),
            "value_head_dim": hf.get("linear_value_head_dim", 128),
            "conv_kernel": hf.get("linear_conv_kernel_dim", 4),
        },
    }


# What every Qwen3.5-style hybrid fixes: gated attention with QK-norm, (1 + w) norms.
HYBRID_FIXED = {
    **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("positions.fraction", "linear")},
    "linear.kind": "gated_deltanet",
    "linear.norm_eps": None,  # the gated norm uses rms_norm_eps
    "linear.allow_neg_eigval": False,
    "linear.pre_norm": False,
    "norms.plus_one": True,
    "attention.qk_norm": "head",
    "attention.output_gate": True,
    "attention.qkv_bias": False,
    "attention.out_bias": False,
    "attention.sliding_window": None,
    "mlp.bias": False,
}
# The config.json keys every Qwen3.5-style hybrid reads (besides Llama's).
HYBRID_KEYS = LLAMA_KEYS | {
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
}
# Tensors of the published files that are not the language model: multi-token prediction
# layers and the vision tower.
IGNORED = r"^(mtp\.|model\.visual\.)"


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's Gated DeltaNet (qwen35, qwen35moe, qwen3next) sizes a value head as a key
    head (`ssm.state_size`): the two must be equal; and it places the attention layers by
    `full_attention_interval` alone (every k-th layer), so another order cannot be written."""
    lin = cfg.linear
    wrong = {}
    if lin.value_head_dim != lin.key_head_dim:
        wrong["linear.value_head_dim"] = lin.value_head_dim
    kinds = cfg.layer_kinds()
    every = kinds.index("full") + 1 if "full" in kinds else 0
    if kinds != tuple(
        "full" if every and (i + 1) % every == 0 else "linear" for i in range(len(kinds))
    ):
        wrong["linear.pattern"] = lin.pattern
    return wrong


FAMILY = Family(
    name="qwen3_5",
    released="2026-02",
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    fixed=HYBRID_FIXED,
    table=TABLE,
    layouts=(VISION_LANGUAGE_TABLE,),
    prefix=LLAMA_PREFIX,
    hf_keys=HYBRID_KEYS | set(PUBLISHED),
    to_hf=to_hf,
    from_hf=hybrid_from_hf,
    wrapper="qwen3_5",
    ignored=IGNORED,
    gguf="qwen35",
    gguf_refuses=gguf_refuses,
)
