"""Granite 4.0-H (IBM, 2025): a hybrid stack of Mamba-2 and attention layers, each followed by a
mixture of experts with an always-on shared MLP, with Granite's four multipliers.

`layer_types` says per layer "mamba" or "attention" (transformers 5 also writes
"linear_attention" and "full_attention"); eqllm keeps it as `linear.pattern`, the list's
shortest period (the published 40-layer stacks: five Mamba-2 layers, one attention layer, four
Mamba-2 layers, repeated four times), so any sequence of the two kinds imports. A stack of
attention layers alone (granite-4.0-micro, -1b, -350m) has no `linear` group. The mixer is
Mamba-2 with its gated RMSNorm after the gate, taken per group of heads. Every layer is
x + r * mixer(norm(x)), then x + r * (experts(norm(x)) + shared(norm(x))): a top-k softmax over
the router's k best logits (the same weights as softmax, top-k, renormalise) and a SwiGLU
shared MLP without a gate of its own; with `num_local_experts` 0 (the dense sizes) only the
shared MLP, which is then eqllm's plain SwiGLU MLP. `position_embedding_type` "rope" rotates
queries and keys; anything else (the published "nope") uses no positions.

The multipliers are `ModelConfig.multipliers` fields, applied in the forward as transformers
applies them, none folded into a weight (so weights import and export bit for bit):
`embedding_multiplier` -> `embedding`, `residual_multiplier` -> `residual`, `logits_scaling` ->
`logits_divisor` (a division, as transformers divides) and `attention_multiplier` ->
`attention_scale`, the softmax scale itself (transformers' default 1.0, not 1/sqrt(head_dim)).

Checkpoints store the experts fused: `block_sparse_moe.input_linear` [E, 2 d_ff, d_model]
(gate rows, then up rows), `output_linear` and `router.layer`; transformers 5 renames them
`experts.gate_up_proj`, `experts.down_proj` and `router` in the model it builds (and back on
saving). Import reads both; export writes the checkpoints' names. PEFT's `input_linear` and
`output_linear` name the shared MLP alone, as in transformers' model (`Row.module`).
"""

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.config.multipliers import MultipliersConfig
from eqllm.families._moe import MOE_KEYS, moe_from_hf, moe_to_hf
from eqllm.families.base import (
    LLAMA_BLOCK,
    LLAMA_KEYS,
    LLAMA_PREFIX,
    PLAIN_EXPERTS,
    Family,
    attention_bias_from_hf,
    llama_from_hf,
    llama_to_hf,
    need,
    one_attention_bias,
    refuse,
    rows,
)
from eqllm.families.mamba2 import gguf_refuses_mamba2, mamba_keys_from_hf, mamba_keys_to_hf

LAYER = "model.layers.{i}."
MIXER = LAYER + "mamba."
STACKS = ("blocks", "linear_blocks")  # attention layers, Mamba-2 layers
MAMBA_PARTS = ("z", "x", "B", "C", "dt")


def _mlp_rows(stack: str, experts_layout: str) -> tuple:
    """One stack's MLP rows: the dense SwiGLU (no experts), or the shared MLP, router and fused
    experts (`experts_layout`: "published" names or transformers 5's)."""
    shared, moe = f"{LAYER}shared_mlp.", f"{LAYER}block_sparse_moe."
    dense = rows(
        (f"{shared}input_linear.weight", (f"{stack}.mlp.gate.weight", f"{stack}.mlp.up.weight")),
        (f"{shared}output_linear.weight", f"{stack}.mlp.down.weight"),
        experts=False,
    )
    shared_rows = rows(
        (
            f"{shared}input_linear.weight",
            (f"{stack}.mlp.shared.gate.weight", f"{stack}.mlp.shared.up.weight"),
        ),
        (f"{shared}output_linear.weight", f"{stack}.mlp.shared.down.weight"),
        experts=True,
    )
    gate_up, down, router = {
        "published": ("input_linear.weight", "output_linear.weight", "router.layer.weight"),
        "fused": ("experts.gate_up_proj", "experts.down_proj", "router.weight"),
    }[experts_layout]
    expert_rows = (
        *rows((f"{moe}{router}", f"{stack}.mlp.router.weight"), experts=True),
        *rows((f"{moe}{down}", f"{stack}.mlp.down.weight"), experts=True, module=False),
        *rows(
            (f"{moe}{gate_up}", (f"{stack}.mlp.gate.weight", f"{stack}.mlp.up.weight")),
            axis=1,
            experts=True,
            module=False,
        ),
    )
    return (*dense, *shared_rows, *expert_rows)


def _table(experts_layout: str) -> tuple:
    attention = tuple(
        (f"{LAYER}self_attn.{p}_proj.{w}", f"blocks.attn.{p}_proj.{w}")
        for p in "qkvo"
        for w in ("weight", "bias")
    )
    mixer = "linear_blocks.attn."
    return (
        *rows(("model.embed_tokens.weight", "embed.weight")),
        *(
            r
            for stack in STACKS
            for r in rows(
                (f"{LAYER}input_layernorm.weight", f"{stack}.attn_norm.weight"),
                (f"{LAYER}post_attention_layernorm.weight", f"{stack}.mlp_norm.weight"),
            )
        ),
        *rows(*attention),
        *rows(
            (f"{MIXER}conv1d.bias", f"{mixer}conv_bias"),
            (f"{MIXER}dt_bias", f"{mixer}dt_bias"),
            (f"{MIXER}A_log", f"{mixer}A_log"),
            (f"{MIXER}D", f"{mixer}D"),
            (f"{MIXER}norm.weight", f"{mixer}norm.weight"),
            (f"{MIXER}out_proj.weight", f"{mixer}out_proj.weight"),
            # in_proj stacks z, x, B, C and dt, in that order (Mamba-2's).
            (f"{MIXER}in_proj.weight", tuple(f"{mixer}{p}_proj.weight" for p in MAMBA_PARTS)),
        ),
        *rows((f"{MIXER}conv1d.weight", f"{mixer}conv_weight"), depthwise=True),
        *(r for stack in STACKS for r in _mlp_rows(stack, experts_layout)),
        *rows(("model.norm.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")),
    )


TABLE = _table("published")
FUSED = _table("fused")

# config.json's spellings of the two layer kinds (transformers 5 remaps the first to the second).
KINDS = {
    "mamba": "linear",
    "linear_attention": "linear",
    "attention": "full",
    "full_attention": "full",
}
_DEFAULTS = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}  # GraniteMoeHybridConfig's


def period(kinds: list[str]) -> tuple[str, ...]:
    """The shortest prefix of `kinds` that, repeated, gives `kinds` (the whole list if none
    shorter does)."""
    n = len(kinds)
    for p in range(1, n + 1):
        if all(kinds[i] == kinds[i % p] for i in range(n)):
            return tuple(kinds[:p])
    return tuple(kinds)


def _kinds(hf: dict[str, Any], n_layers: int) -> list[str]:
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n_layers
    unknown = sorted({t for t in types if t not in KINDS})
    if unknown or len(types) != n_layers:
        raise ConfigError(
            f"config.json layer_types={types} must give each of the {n_layers} layers one of "
            f"{sorted(KINDS)}"
        )
    kinds = [KINDS[t] for t in types]
    if "full" not in kinds:
        raise ConfigError(
            f"config.json layer_types={types} has no attention layer; eqllm's granitemoehybrid "
            "needs at least one (a stack of Mamba-2 layers alone is the mamba2 family)"
        )
    return kinds


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m, lin, moe = cfg.multipliers or MultipliersConfig(), cfg.linear, cfg.moe
    hf = {k: v for k, v in llama_to_hf(cfg).items() if k != "head_dim"}
    if cfg.head_dim != cfg.d_model // cfg.attention.n_heads:
        hf["head_dim"] = cfg.head_dim
    kinds = cfg.layer_kinds()
    hf |= {
        "hidden_act": "silu",
        "attention_bias": cfg.attention.qkv_bias,
        "layer_types": ["mamba" if k == "linear" else "attention" for k in kinds],
        "position_embedding_type": "rope" if cfg.positions.kind == "rope" else "nope",
        "embedding_multiplier": m.embedding,
        "residual_multiplier": m.residual,
        "logits_scaling": m.logits_divisor,
        # Unset: 1 / sqrt(head_dim), what eqllm's attention computes.
        "attention_multiplier": m.attention_scale or cfg.head_dim**-0.5,
        "shared_intermediate_size": cfg.mlp.d_ff if moe is None else moe.shared_d_ff,
        "num_local_experts": 0 if moe is None else moe.n_experts,
    }
    if moe is not None:
        hf |= {**moe_to_hf(cfg), "intermediate_size": cfg.expert_d_ff}
    if lin is not None:
        hf |= {
            **mamba_keys_to_hf(lin),
            "mamba_expand": lin.n_value_heads * lin.value_head_dim // cfg.d_model,
        }
    return hf


def _multipliers(hf: dict[str, Any], head_dim: int) -> dict[str, float] | None:
    """The `multipliers` group of config.json's four (None where each is plain: 1.0, and the
    attention scale 1 / sqrt(head_dim), as eqllm exports a config without them)."""
    m = {
        "embedding": float(hf.get("embedding_multiplier", 1.0)),
        "residual": float(hf.get("residual_multiplier", 1.0)),
        "logits_divisor": float(hf.get("logits_scaling", 1.0)),
        "attention_scale": float(hf.get("attention_multiplier", 1.0)),
    }
    plain = m["attention_scale"] == head_dim**-0.5
    return None if plain and {m[k] for k in m if k != "attention_scale"} == {1.0} else m


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse(hf, "hidden_act", ("silu",))
    refuse(hf, "mamba_proj_bias", (False,))
    refuse(hf, "mamba_conv_bias", (True,))
    refuse(hf, "position_embedding_type", ("rope", "nope", None))
    refuse(hf, "normalization_function", ("rmsnorm",))  # a published key transformers ignores
    # init_method ("mup" in the releases) names how IBM initialised training: it changes no
    # forward, and eqllm initialises as its own parametrization says.
    d = llama_from_hf(hf)
    n_layers = d["n_layers"]
    kinds = _kinds(hf, n_layers)
    out = {
        **d,
        **attention_bias_from_hf(hf),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "positions.kind": "rope" if hf.get("position_embedding_type") == "rope" else "none",
        "multipliers": _multipliers(hf, d["attention.head_dim"]),
    }
    shared = hf.get("shared_intermediate_size", 1024)
    if hf.get("num_local_experts", 8):
        out |= {
            **EXPERTS,
            **moe_from_hf(hf, _DEFAULTS),
            "moe.n_experts": hf.get("num_local_experts", 8),
            "mlp.d_ff": need(hf, "intermediate_size"),  # the experts' (moe.d_ff unset)
            "moe.shared_d_ff": shared,
        }
    else:  # the dense sizes: the shared MLP alone
        out["mlp.d_ff"] = shared
    if "linear" not in kinds:
        return out
    expand = hf.get("mamba_expand", 2)
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = expand * d["d_model"] // heads if head_dim in ("auto", None) else head_dim
    if heads * head_dim != expand * d["d_model"]:
        raise ConfigError(
            f"config.json mamba_n_heads * mamba_d_head = {heads * head_dim} must equal "
            f"mamba_expand * hidden_size = {expand * d['d_model']} (transformers requires it)"
        )
    out["linear"] = {
        **MIXER_FIXED,
        "pattern": period(kinds),
        **mamba_keys_from_hf(hf, heads, head_dim),
    }
    return out


# The groups a Granite config may or may not have (and positions, rotary or none): `fixed`
# leaves them out; these are their settings where they are present.
OPTIONAL = ("linear", "moe", "multipliers", "positions.kind")
EXPERTS = {**PLAIN_EXPERTS, "moe.shared_gated": False, "moe.norm_topk_prob": True}
MIXER_FIXED = {
    "kind": "mamba2",
    "full_every": None,
    "parallel": False,
    "mlp": True,
    "pre_norm": False,
    "norm_eps": None,
    "gate_norm": "after_gate",
    "allow_neg_eigval": False,
}


def _check(cfg: ModelConfig) -> dict[str, Any]:
    """Granite's invariants: only its four multipliers, a pattern with attention, the shared
    MLP beside any experts, experts routed as Granite routes them."""
    bad = one_attention_bias(cfg)
    m = cfg.multipliers or MultipliersConfig()
    others = MultipliersConfig(
        embedding=m.embedding,
        residual=m.residual,
        logits_divisor=m.logits_divisor,
        attention_scale=m.attention_scale,
    )
    if m != others:
        bad["multipliers"] = m
    if cfg.positions.kind not in ("rope", "none"):
        bad["positions.kind"] = cfg.positions.kind
    if cfg.moe is not None:
        bad |= {k: cfg.at(k) for k, v in EXPERTS.items() if cfg.at(k) != v}
        if cfg.moe.shared_d_ff is None:
            bad["moe.shared_d_ff"] = None
        if cfg.moe.d_ff is not None:  # config.json has one size, intermediate_size: mlp.d_ff
            bad["moe.d_ff"] = cfg.moe.d_ff
    lin = cfg.linear
    if lin is not None:
        bad |= {
            f"linear.{k}": getattr(lin, k) for k, v in MIXER_FIXED.items() if getattr(lin, k) != v
        }
        if lin.pattern is None or "full" not in lin.pattern:
            bad["linear.pattern"] = lin.pattern
    return bad


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's granitehybrid runs Mamba-2 as its mamba2 does (`gguf_refuses_mamba2`). A
    stack of attention layers alone (no `linear` group) is its converter's granite or
    granitemoe architecture, which eqllm does not write."""
    return {"linear": None} if cfg.linear is None else gguf_refuses_mamba2(cfg.linear)


FAMILY = Family(
    name="granitemoehybrid",
    released="2025-10",
    architecture="GraniteMoeHybridForCausalLM",
    model_type="granitemoehybrid",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in OPTIONAL},
        "positions.scaling": None,
        "attention.sliding_window": None,
        "mlp.bias": False,
    },
    table=TABLE,
    layouts=(FUSED,),
    prefix=LLAMA_PREFIX,
    hf_keys=LLAMA_KEYS
    | MOE_KEYS
    | frozenset(
        """
        attention_bias layer_types layers_block_type position_embedding_type
        embedding_multiplier residual_multiplier logits_scaling attention_multiplier
        shared_intermediate_size num_local_experts mamba_n_heads mamba_n_groups mamba_d_state
        mamba_d_head mamba_d_conv mamba_expand mamba_chunk_size mamba_conv_bias mamba_proj_bias
        time_step_limit normalization_function init_method
        """.split()
    ),
    to_hf=to_hf,
    from_hf=from_hf,
    check=_check,
    gguf="granitehybrid",
    gguf_refuses=gguf_refuses,
)
