"""Mamba-2 (Dao & Gu, 2024): a stack of Mamba-2 layers alone, no attention and no MLP.

Every layer is RMSNorm -> Mamba-2 mixer (`eqllm.nn.Mamba2`) -> residual; a final RMSNorm and a
head, tied (state-spaces' releases) or not (Mamba-Codestral). In eqllm it is the `linear` group
of kind "mamba2" with `full_every` unset (no attention layers) and `mlp` False: its layers are
one stack, `blocks`. The `attention` and `mlp` groups, which a ModelConfig always has, are left
at placeholder sizes (one head, d_ff 1) that build nothing.

transformers computes the residual in fp32 (`residual_in_fp32`); eqllm keeps it in the compute
dtype, the same in fp32. transformers' recurrent path (one cached token) does not clamp dt to
`time_step_limit` where its chunked path does; eqllm clamps in both, and the published limits,
(0, inf), leave softplus's output as it is either way.

state-spaces' releases ship mamba_ssm's own config.json (d_model, n_layer, ssm_cfg; no
model_type) and `embedding` where transformers has `embeddings`: `from_mamba_ssm` reads the
former as transformers' Mamba2Config, `SSM_TABLE` the latter.
"""

import math
from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import LLAMA_BLOCK, Family, need, refuse, rows

PREFIX = "backbone."


def _table(embedding: str) -> tuple:
    layer = "backbone.layers.{i}."
    mixer = layer + "mixer."
    return (
        *rows(
            (f"backbone.{embedding}.weight", "embed.weight"),
            (f"{layer}norm.weight", "blocks.attn_norm.weight"),
            (f"{mixer}conv1d.bias", "blocks.attn.conv_bias"),
            (f"{mixer}dt_bias", "blocks.attn.dt_bias"),
            (f"{mixer}A_log", "blocks.attn.A_log"),
            (f"{mixer}D", "blocks.attn.D"),
            (f"{mixer}norm.weight", "blocks.attn.norm.weight"),
            (f"{mixer}out_proj.weight", "blocks.attn.out_proj.weight"),
        ),
        # in_proj stacks z, x, B, C and dt, in that order.
        *rows(
            (
                f"{mixer}in_proj.weight",
                tuple(f"blocks.attn.{p}_proj.weight" for p in ("z", "x", "B", "C", "dt")),
            )
        ),
        *rows((f"{mixer}conv1d.weight", "blocks.attn.conv_weight"), depthwise=True),
        *rows(
            ("backbone.norm_f.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")
        ),
    )


TABLE = _table("embeddings")
# state-spaces' mamba_ssm checkpoints name the embedding `embedding` (transformers renames it).
SSM_TABLE = _table("embedding")


def step_limit(value: Any) -> float:
    """One end of time_step_limit as config.json holds it: a number, "Infinity", or
    transformers 5's {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def mamba_keys_from_hf(hf: dict[str, Any], heads: int, head_dim: int) -> dict[str, Any]:
    """`ModelConfig.linear`'s Mamba-2 sizes from the `mamba_*` keys Falcon-H1 and Granite
    4.0-H share (with `heads` x `head_dim` already checked against the inner size)."""
    low, high = (step_limit(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
    return {
        "n_key_heads": hf.get("mamba_n_groups", 1),
        "n_value_heads": heads,
        "key_head_dim": hf.get("mamba_d_state", 256),
        "value_head_dim": head_dim,
        "conv_kernel": hf.get("mamba_d_conv", 4),
        "chunk_size": hf.get("mamba_chunk_size", 256),
        "dt_min": low,
        "dt_max": None if math.isinf(high) else high,
    }


def mamba_keys_to_hf(lin) -> dict[str, Any]:
    """The inverse of `mamba_keys_from_hf` for `lin` (a Mamba-2 `LinearConfig`)."""
    return {
        "mamba_n_heads": lin.n_value_heads,
        "mamba_d_head": lin.value_head_dim,
        "mamba_n_groups": lin.n_key_heads,
        "mamba_d_state": lin.key_head_dim,
        "mamba_d_conv": lin.conv_kernel,
        "mamba_chunk_size": lin.chunk_size,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "time_step_limit": [lin.dt_min, math.inf if lin.dt_max is None else lin.dt_max],
    }


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    lin = cfg.linear
    return {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": lin.n_value_heads,
        "head_dim": lin.value_head_dim,
        "expand": lin.n_value_heads * lin.value_head_dim // cfg.d_model,
        "state_size": lin.key_head_dim,
        "n_groups": lin.n_key_heads,
        "conv_kernel": lin.conv_kernel,
        "chunk_size": lin.chunk_size,
        "time_step_limit": [lin.dt_min, math.inf if lin.dt_max is None else lin.dt_max],
        "layer_norm_epsilon": cfg.norms.eps,
        "hidden_act": "silu",
        "use_bias": False,
        "use_conv_bias": True,
        "residual_in_fp32": True,
        "max_position_embeddings": cfg.max_seq_len,
    }


def check(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' Mamba2Config holds the inner size as an integer `expand` of hidden_size."""
    lin = cfg.linear
    inner = lin.n_value_heads * lin.value_head_dim
    return {} if inner % cfg.d_model == 0 else {"linear.n_value_heads": lin.n_value_heads}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "use_bias", (False,))
    refuse(hf, "use_conv_bias", (True,))
    refuse(hf, "rms_norm", (True,))
    d, heads, head_dim = need(hf, "hidden_size"), hf.get("num_heads", 128), hf.get("head_dim", 64)
    expand = hf.get("expand", 2)
    if d * expand != heads * head_dim:
        raise ConfigError(
            f"config.json hidden_size * expand = {d * expand} must equal num_heads * head_dim "
            f"= {heads * head_dim} (transformers' Mamba2Config requires it)"
        )
    low, high = (step_limit(v) for v in hf.get("time_step_limit", (0.0, math.inf)))
    return {
        "vocab_size": need(hf, "vocab_size"),
        "d_model": d,
        "n_layers": need(hf, "num_hidden_layers"),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "norms.eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "linear": {
            "n_key_heads": hf.get("n_groups", 8),
            "n_value_heads": heads,
            "key_head_dim": hf.get("state_size", 128),
            "value_head_dim": head_dim,
            "conv_kernel": hf.get("conv_kernel", 4),
            "chunk_size": hf.get("chunk_size", 256),
            "dt_min": low,
            "dt_max": None if math.isinf(high) else high,
        },
    }


# mamba_ssm's own config.json, which state-spaces' Mamba-2 releases ship (its MambaConfig: no
# model_type), and the defaults of mamba_ssm's Mamba2 layer for what `ssm_cfg` leaves out.
SSM_KEYS = frozenset(
    """
    d_model d_intermediate n_layer vocab_size ssm_cfg attn_layer_idx attn_cfg rms_norm
    residual_in_fp32 fused_add_norm pad_vocab_size_multiple tie_embeddings norm_epsilon
    """.split()
)
SSM_LAYER = {
    "d_state": 128,
    "d_conv": 4,
    "expand": 2,
    "headdim": 64,
    "ngroups": 1,
    "chunk_size": 256,
}


def is_mamba_ssm(hf: dict[str, Any]) -> bool:
    """`hf` is mamba_ssm's config.json rather than transformers'."""
    return "model_type" not in hf and isinstance(hf.get("ssm_cfg"), dict) and "d_model" in hf


def from_mamba_ssm(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers' Mamba2Config keys for mamba_ssm's config.json, read as transformers'
    conversion script reads it: the vocabulary padded to `pad_vocab_size_multiple`, mamba_ssm's
    Mamba2 defaults for the layer settings `ssm_cfg` leaves out. Mamba-1 layers, attention
    layers (`attn_layer_idx`, mamba2attn) and MLPs (`d_intermediate`) are refused by name."""
    unknown = sorted(set(hf) - SSM_KEYS)
    layer = dict(hf["ssm_cfg"])
    kind = layer.pop("layer", "Mamba1")
    unknown += sorted(f"ssm_cfg.{k}" for k in set(layer) - set(SSM_LAYER))
    if unknown:
        raise ConfigError(
            f"mamba_ssm config.json has setting(s) eqllm does not understand: {unknown}; "
            "refusing rather than building a model that may compute something else"
        )
    for key, value, plain in (
        ("ssm_cfg.layer", kind, "Mamba2"),
        ("attn_layer_idx", list(hf.get("attn_layer_idx") or []), []),
        ("d_intermediate", hf.get("d_intermediate", 0), 0),
        ("rms_norm", hf.get("rms_norm", True), True),
    ):
        if value != plain:
            raise ConfigError(
                f"mamba_ssm config.json {key}={value!r} is not supported: eqllm's mamba2 reads "
                f"Mamba-2 layers alone ({key}={plain!r})"
            )
    layer = {**SSM_LAYER, **layer}
    d, multiple = hf["d_model"], hf.get("pad_vocab_size_multiple", 8)
    vocab = hf["vocab_size"] + (-hf["vocab_size"] % multiple)
    return {
        "model_type": "mamba2",
        "hidden_size": d,
        "num_hidden_layers": hf["n_layer"],
        "vocab_size": vocab,
        "num_heads": layer["expand"] * d // layer["headdim"],
        "head_dim": layer["headdim"],
        "expand": layer["expand"],
        "state_size": layer["d_state"],
        "n_groups": layer["ngroups"],
        "conv_kernel": layer["d_conv"],
        "chunk_size": layer["chunk_size"],
        "layer_norm_epsilon": hf.get("norm_epsilon", 1e-5),
        "tie_word_embeddings": bool(hf.get("tie_embeddings", True)),
    }


def gguf_refuses_mamba2(lin) -> dict[str, Any]:
    """What llama.cpp's Mamba-2 cannot hold: it never clamps dt, and norms after the gate."""
    wrong = {"linear.dt_min": lin.dt_min} if lin.dt_min != 0.0 else {}
    if lin.dt_max is not None:
        wrong["linear.dt_max"] = lin.dt_max
    if lin.gate_norm == "before_gate":
        wrong["linear.gate_norm"] = lin.gate_norm
    return wrong


FAMILY = Family(
    name="mamba2",
    released="2024-05",
    architecture="Mamba2ForCausalLM",
    model_type="mamba2",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k != "linear"},
        "linear.kind": "mamba2",
        "linear.pattern": None,
        "linear.full_every": None,
        "linear.mlp": False,
        # No attention and no MLP layers: the groups a ModelConfig must have, at placeholders.
        "attention.n_heads": 1,
        "mlp.d_ff": 1,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "mlp.bias": False,
    },
    table=TABLE,
    layouts=(SSM_TABLE,),
    prefix=PREFIX,
    hf_keys=frozenset(
        """
        hidden_size num_hidden_layers num_heads head_dim expand state_size n_groups conv_kernel
        chunk_size time_step_limit layer_norm_epsilon hidden_act use_bias use_conv_bias
        residual_in_fp32 rescale_prenorm_residual time_step_rank time_step_min time_step_max
        time_step_floor max_position_embeddings rms_norm
        """.split()
    ),
    to_hf=to_hf,
    from_hf=from_hf,
    check=check,
    gguf="mamba2",
    gguf_refuses=lambda cfg: gguf_refuses_mamba2(cfg.linear),
)
