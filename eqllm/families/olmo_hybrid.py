"""OLMo Hybrid (Team OLMo, 2026): OLMo 3's attention layers (post-norm: RMSNorm on the outputs
of attention and MLP; QK-norm over the whole q and k projections) with three Gated DeltaNet
layers (Yang, Kautz & Hatamizadeh, 2025) before each of them; config.json's `layer_types` reads
in any order of the two kinds (`eqllm.families._hybrid`).

The Gated DeltaNet layers differ from Qwen3.5's: they are pre-norm (RMSNorm before the mixer and
before the MLP, as Llama), key heads as many as value heads by default, the write strength is
2 * sigmoid(b) (`linear_allow_neg_eigval`), the gated output norm's epsilon is 1e-5 whatever
`rms_norm_eps` says, and every projection is its own tensor (q, k, v, a, b, the output gate
`g_proj`, `o_proj`). Only the attention layers rotate; the 7B release has no RoPE at all
(`rope_parameters.rope_theta` null), which eqllm reads as `positions.kind = "none"`.

Checkpoints name the DeltaNet layers' tensors three ways, all of which transformers loads (its
conversion mapping renames `attention_layer_norm` and `feedforward_layer_norm` and concatenates
`q_conv1d`, `k_conv1d` and `v_conv1d` into its model's one `conv1d`):
- transformers' save_pretrained writes the renamed norms, on every layer, and the convolution in
  three near-equal thirds (torch.chunk), not at the q/k/v boundaries; export writes these names,
  as transformers does, with the convolution cut at the q, k and v channels;
- the release, as a public account of the 7B file's header gives it: the model's norm names and
  the convolution cut at q, k and v;
- transformers' model itself (`input_layernorm`, `post_attention_layernorm`, one `conv1d`).
Import reads all three, and any cut of the convolution (the parts are concatenated in order).
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families._hybrid import from_layer_types, to_layer_types
from eqllm.families._rope import rope_params
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    Family,
    Row,
    llama_from_hf,
    llama_to_hf,
    need,
    refuse,
    rows,
    token_ids,
)

_LAYER = "model.layers.{i}."
_GDN = _LAYER + "linear_attn."
_MLP = [
    (f"{_LAYER}mlp.gate_proj.weight", "mlp.gate.weight"),
    (f"{_LAYER}mlp.up_proj.weight", "mlp.up.weight"),
    (f"{_LAYER}mlp.down_proj.weight", "mlp.down.weight"),
]


def _table(pre: str, post: str, attn_post: str, conv: tuple[tuple[str, str], ...]) -> tuple:
    """The key table with the DeltaNet layers' norms named `pre` and `post`, the attention
    layers' output norm `attn_post`, and the convolution one tensor (`conv` empty) or one per
    entry of `conv` (`{part}_conv1d`). The attention layers are OLMo 3's: norms on the
    sublayers' outputs, QK-norm, no biases; the DeltaNet layers are pre-norm."""
    conv_name = f"{_GDN}{{part}}_conv1d.weight" if conv else f"{_GDN}conv1d.weight"
    return (
        *rows(
            ("model.embed_tokens.weight", "embed.weight"),
            *[(hf, f"blocks.{p}") for hf, p in _MLP],
            *[
                (f"{_LAYER}self_attn.{p}.weight", f"blocks.attn.{p}.weight")
                for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            ],
            (f"{_LAYER}{attn_post}.weight", "blocks.attn_post_norm.weight"),
            (f"{_LAYER}post_feedforward_layernorm.weight", "blocks.mlp_post_norm.weight"),
            *[(hf, f"linear_blocks.{p}") for hf, p in _MLP],
            (f"{_LAYER}{pre}.weight", "linear_blocks.attn_norm.weight"),
            (f"{_LAYER}{post}.weight", "linear_blocks.mlp_norm.weight"),
            *[
                (f"{_GDN}{p}_proj.weight", f"linear_blocks.attn.{p}_proj.weight")
                for p in ("q", "k", "v", "a", "b")
            ],
            (f"{_GDN}g_proj.weight", "linear_blocks.attn.z_proj.weight"),
            (f"{_GDN}o_proj.weight", "linear_blocks.attn.out_proj.weight"),
            (f"{_GDN}o_norm.weight", "linear_blocks.attn.norm.weight"),
            (f"{_GDN}A_log", "linear_blocks.attn.A_log"),
            (f"{_GDN}dt_bias", "linear_blocks.attn.dt_bias"),
        ),
        Row(conv_name, ("linear_blocks.attn.conv_weight",), depthwise=True, parts=conv),
        *rows(("model.norm.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")),
    )


# The names transformers' save_pretrained writes (its conversion mapping reversed, on every
# layer's norms): export writes these.
_QKV = tuple((p, f"linear_blocks.attn.{p}_proj.weight") for p in "qkv")
TABLE = _table("attention_layer_norm", "feedforward_layer_norm", "feedforward_layer_norm", _QKV)
# The release's names (the model's norms, the convolution in three) and the model's own.
RELEASE = _table("input_layernorm", "post_attention_layernorm", "post_attention_layernorm", _QKV)
MODEL_TABLE = _table("input_layernorm", "post_attention_layernorm", "post_attention_layernorm", ())

_TOKEN_IDS = {"eos_token_id": 100257, "pad_token_id": 100277}  # OlmoHybridConfig's
_GATED_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet fixes its o_norm's epsilon


def _layer_types(n_layers: int) -> list[str]:
    """OlmoHybridConfig's default `layer_types`: every fourth layer full attention, or only the
    last one in a model of fewer than four layers."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE on the attention layers, or none where `rope_theta` is null (the 7B release)."""
    rope = rope_params(hf)
    if rope.get("rope_theta", 0.0) is None:
        if set(rope) - {"rope_theta", "rope_type"} or rope["rope_type"] != "default":
            raise ConfigError(f"config.json rope_parameters={rope} scale a RoPE with no base")
        return {"positions.kind": "none"}
    if rope["rope_type"] != "default" or set(rope) - {"rope_theta", "rope_type", "type"}:
        raise ConfigError(
            f"config.json rope settings {rope} are not supported; eqllm's OLMo hybrid reads "
            "plain RoPE (rope_type 'default') or none (rope_theta null)"
        )
    return {"positions.kind": "rope", "positions.theta": float(rope.get("rope_theta", 10000.0))}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    lin = cfg.linear
    hf = {k: v for k, v in llama_to_hf(cfg).items() if k not in ("rope_theta", "rope_scaling")}
    del hf["head_dim"]  # transformers' OLMo hybrid derives it: hidden_size / num_attention_heads
    rope = cfg.positions.theta if cfg.positions.kind == "rope" else None
    return {
        **token_ids(cfg, _TOKEN_IDS),
        **hf,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": to_layer_types(cfg),
        "linear_conv_kernel_dim": lin.conv_kernel,
        "linear_key_head_dim": lin.key_head_dim,
        "linear_value_head_dim": lin.value_head_dim,
        "linear_num_key_heads": lin.n_key_heads,
        "linear_num_value_heads": lin.n_value_heads,
        "linear_allow_neg_eigval": lin.allow_neg_eigval,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope},
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "attention_bias", (False,))
    d, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    n_layers = need(hf, "num_hidden_layers")
    key_heads = hf.get("linear_num_key_heads") or n_heads
    key_dim = hf.get("linear_key_head_dim") or int(0.75 * d / key_heads)
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    return {
        **llama_from_hf({**plain, "rope_theta": 10000.0}),
        **_rope(hf),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "linear": {
            **from_layer_types(
                hf.get("layer_types") or _layer_types(n_layers),
                n_layers,
                "OLMo hybrid",
                needs_linear=True,
            ),
            "n_key_heads": key_heads,
            "n_value_heads": hf.get("linear_num_value_heads") or n_heads,
            "key_head_dim": key_dim,
            "value_head_dim": hf.get("linear_value_head_dim") or 2 * key_dim,
            "conv_kernel": hf.get("linear_conv_kernel_dim", 4),
            "allow_neg_eigval": bool(hf.get("linear_allow_neg_eigval", True)),
            "norm_eps": _GATED_NORM_EPS,
            "pre_norm": True,
        },
    }


FAMILY = Family(
    name="olmo_hybrid",
    released="2026-03",
    architecture="OlmoHybridForCausalLM",
    model_type="olmo_hybrid",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("positions.kind", "linear")},
        "linear.kind": "gated_deltanet",
        "linear.norm_eps": _GATED_NORM_EPS,
        "linear.pre_norm": True,
        "attention.qk_norm": "whole",
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "attention.sliding_window": None,
        "mlp.bias": False,
        "norms.pre": False,
        "norms.post": True,
    },
    table=TABLE,
    layouts=(RELEASE, MODEL_TABLE),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | {
        "attention_bias",
        "layer_types",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_allow_neg_eigval",
        # Initialisation ranges of A_log and dt_bias (training from scratch in transformers).
        "linear_a_log_min",
        "linear_a_log_max",
        "linear_dt_min",
        "linear_dt_max",
        "linear_dt_init_floor",
    },
    to_hf=to_hf,
    from_hf=from_hf,
    # transformers' OLMo hybrid derives the head size from hidden_size / num_attention_heads;
    # it has RoPE or none, never a learned table.
    check=lambda cfg: {
        **(
            {}
            if cfg.head_dim * cfg.attention.n_heads == cfg.d_model
            else {"attention.head_dim": cfg.head_dim}
        ),
        **({"positions.kind": "learned"} if cfg.positions.kind == "learned" else {}),
    },
)
