"""Falcon-H1 (TII, 2025): attention and Mamba-2 in parallel in every block, then a SwiGLU MLP.

Every layer is x + attn(norm(x) * a_in) * a_out + mamba(norm(x)) * s_out, then
x + mlp(norm(x)): one uniform stack (`linear.parallel`, the Mamba-2 mixer beside attention in
each `Block`, run by `run_blocks`). The mixer is transformers' `FalconH1Mixer`: Mamba-2 with its
gated RMSNorm optional (`mamba_rms_norm`, false in every release: y * silu(z)) or before the
gate (`mamba_norm_before_gate`). The model carries its training's muP multipliers in config.json
(`embedding_multiplier`, `lm_head_multiplier`, `attention_in/out_multiplier`,
`key_multiplier`, `ssm_in/out_multiplier`, `ssm_multipliers` over in_proj's z, x, B, C and dt,
`mlp_multipliers` for gate and down): they are `ModelConfig.multipliers`, applied in the
forward as transformers applies them (the key multiplier as a factor on the softmax scale, the
same scores), so weights import and export bit for bit.

transformers computes the residual in the compute dtype too; its `mup_vector` is a buffer it
rebuilds from the config, never in a checkpoint. In cached generation each layer's cache entry
is the pair (its KV cache, its Mamba-2 state) (`CausalLM.init_cache`).
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    Family,
    llama_from_hf,
    llama_to_hf,
    refuse,
    rows,
)
from eqllm.families.mamba2 import gguf_refuses_mamba2, mamba_keys_from_hf, mamba_keys_to_hf

LAYER = "model.layers.{i}."
MIXER = LAYER + "mamba."
TABLE = (
    *rows(
        ("model.embed_tokens.weight", "embed.weight"),
        (f"{LAYER}input_layernorm.weight", "blocks.attn_norm.weight"),
        (f"{LAYER}self_attn.q_proj.weight", "blocks.attn.q_proj.weight"),
        (f"{LAYER}self_attn.k_proj.weight", "blocks.attn.k_proj.weight"),
        (f"{LAYER}self_attn.v_proj.weight", "blocks.attn.v_proj.weight"),
        (f"{LAYER}self_attn.o_proj.weight", "blocks.attn.o_proj.weight"),
        (f"{MIXER}conv1d.bias", "blocks.ssm.conv_bias"),
        (f"{MIXER}dt_bias", "blocks.ssm.dt_bias"),
        (f"{MIXER}A_log", "blocks.ssm.A_log"),
        (f"{MIXER}D", "blocks.ssm.D"),
        (f"{MIXER}norm.weight", "blocks.ssm.norm.weight"),  # only with mamba_rms_norm
        (f"{MIXER}out_proj.weight", "blocks.ssm.out_proj.weight"),
        (f"{LAYER}pre_ff_layernorm.weight", "blocks.mlp_norm.weight"),
        (f"{LAYER}feed_forward.gate_proj.weight", "blocks.mlp.gate.weight"),
        (f"{LAYER}feed_forward.up_proj.weight", "blocks.mlp.up.weight"),
        (f"{LAYER}feed_forward.down_proj.weight", "blocks.mlp.down.weight"),
        ("model.final_layernorm.weight", "final_norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ),
    # in_proj stacks z, x, B, C and dt, in that order (Mamba-2's).
    *rows(
        (
            f"{MIXER}in_proj.weight",
            tuple(f"blocks.ssm.{p}_proj.weight" for p in ("z", "x", "B", "C", "dt")),
        )
    ),
    *rows((f"{MIXER}conv1d.weight", "blocks.ssm.conv_weight"), depthwise=True),
)

# config.json's multipliers -> ModelConfig.multipliers fields (mlp_multipliers and
# ssm_multipliers are lists: gate, down; z, x, B, C, dt).
MULTIPLIERS = {
    "embedding_multiplier": "embedding",
    "lm_head_multiplier": "logits",
    "attention_in_multiplier": "attention_in",
    "attention_out_multiplier": "attention_out",
    "key_multiplier": "key",
    "ssm_in_multiplier": "ssm_in",
    "ssm_out_multiplier": "ssm_out",
}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    lin, m = cfg.linear, cfg.multipliers
    hf = {
        **llama_to_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "projectors_bias": False,
        **mamba_keys_to_hf(lin),
        "mamba_d_ssm": lin.n_value_heads * lin.value_head_dim,
        "mamba_rms_norm": lin.gate_norm != "none",
        "mamba_norm_before_gate": lin.gate_norm == "before_gate",
    }
    if m is not None:
        hf |= {key: getattr(m, name) for key, name in MULTIPLIERS.items()}
        hf |= {"mlp_multipliers": [m.mlp_gate, m.mlp_down], "ssm_multipliers": list(m.ssm)}
    return hf


def _gate_norm(hf: dict[str, Any]) -> str:
    if not hf.get("mamba_rms_norm", False):
        return "none"
    return "before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate"


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    for key, plain in (
        ("attention_bias", False),
        ("mlp_bias", False),
        ("projectors_bias", False),
        ("mamba_proj_bias", False),
        ("mamba_conv_bias", True),
        ("mamba_use_mlp", True),  # the published files' marker: every layer has its MLP
        ("attn_layer_indices", None),  # attention in every layer, as transformers builds it
    ):
        refuse(hf, key, (plain,))
    d = llama_from_hf(hf, eps=1e-5)
    inner = hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * d["d_model"]
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inner:
        raise ConfigError(
            f"config.json mamba_n_heads * mamba_d_head = {heads * head_dim} must equal the "
            f"mamba inner size {inner} (mamba_d_ssm; transformers' FalconH1Config requires it)"
        )
    multipliers = {name: float(hf.get(key, 1.0)) for key, name in MULTIPLIERS.items()}
    gate, down = hf.get("mlp_multipliers") or (1.0, 1.0)
    multipliers |= {"mlp_gate": float(gate), "mlp_down": float(down)}
    multipliers["ssm"] = tuple(float(v) for v in hf.get("ssm_multipliers") or (1.0,) * 5)
    if len(multipliers["ssm"]) != 5:
        raise ConfigError(
            f"config.json ssm_multipliers={hf['ssm_multipliers']} must be five numbers (z, x, "
            "B, C and dt of in_proj)"
        )
    plain = all(v == 1.0 for v in multipliers.values() if isinstance(v, float))
    return {
        **d,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "multipliers": None if plain and set(multipliers["ssm"]) == {1.0} else multipliers,
        "linear": {
            **mamba_keys_from_hf(hf, heads, head_dim),
            "gate_norm": _gate_norm(hf),
        },
    }


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's Falcon-H1 runs Mamba-2 as its mamba2 does (`gguf_refuses_mamba2`), and its
    converter folds the multipliers into the weights: a tied embedding holds only one."""
    wrong = gguf_refuses_mamba2(cfg.linear)
    m = cfg.multipliers
    if cfg.tie_embeddings and m is not None and m.embedding != m.logits:
        wrong["tie_embeddings"] = True
    return wrong


FAMILY = Family(
    name="falcon_h1",
    released="2025-05",
    architecture="FalconH1ForCausalLM",
    model_type="falcon_h1",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("linear", "multipliers")},
        "attention.sliding_window": None,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "mlp.bias": False,
        "linear.kind": "mamba2",
        "linear.parallel": True,
        "linear.full_every": None,
        "linear.mlp": True,
        "linear.pre_norm": False,
    },
    table=TABLE,
    prefix="model.",
    hf_keys=LLAMA_KEYS
    | frozenset(
        """
        attention_bias mlp_bias projectors_bias mamba_d_ssm mamba_n_heads mamba_d_head
        mamba_n_groups mamba_d_state mamba_d_conv mamba_expand mamba_chunk_size mamba_conv_bias
        mamba_proj_bias mamba_norm_before_gate mamba_rms_norm mamba_use_mlp time_step_limit
        attn_layer_indices num_logits_to_keep mlp_multipliers ssm_multipliers
        """.split()
    )
    | frozenset(MULTIPLIERS),
    to_hf=to_hf,
    from_hf=from_hf,
    gguf="falcon-h1",
    gguf_refuses=gguf_refuses,
)
