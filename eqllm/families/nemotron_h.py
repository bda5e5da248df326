"""NVIDIA's Nemotron-H (NVIDIA, 2025, "Nemotron-H: A Family of Accurate and Efficient Hybrid
Mamba-Transformer Models"; Nemotron Nano 2) and Nemotron 3 (Nemotron 3 Nano 30B-A3B): every
layer is one sublayer with its own RMSNorm and residual, of the kind its pattern says: "M" a
Mamba-2 mixer, "*" softmax attention without rotary embeddings (transformers'
`NemotronHAttention` applies none, whatever `rope_theta` a file carries), "-" a squared-ReLU
MLP without a gate, "E" (Nemotron 3) a mixture of experts.

In eqllm the pattern is `linear.pattern`: "linear" (Mamba-2, `linear.mlp` False), "full"
(attention, `linear.full_mlp` False) and "ffn" (the feed-forward layer alone) layers, three
stacks cut into segments (`eqllm.config.kinds`). config.json gives the pattern as
`hybrid_override_pattern` ("M-M-M-M*-...") or, as transformers 5 writes it,
`layers_block_type` (["linear_attention", "mlp", "full_attention", ...]; the older names
"mamba" and "attention" are read too). Mamba-2's gated RMSNorm is taken per group of heads
(`n_groups`), as eqllm's Mamba2 takes it.

With `moe` set, the "ffn" layers are the "E" layers: a mixture of experts (`eqllm.nn.MoE`) of
ungated squared-ReLU experts (`moe.activation` "relu2": down(relu(up(x))^2)) beside an
always-on ungated squared-ReLU shared expert, routed as DeepSeek-V3 routes (sigmoid scores,
`e_score_correction_bias` to choose, the best `topk_group` of `n_group` groups scored by
their top two, the chosen scores renormalised and times `routed_scaling_factor`). A pattern
with both "-" and "E" layers is refused (the feed-forward layers are of one kind), and so is
Nemotron 3 Super's latent projection (`moe_latent_size`). Checkpoints store one tensor per
expert (`mixer.experts.{j}.up_proj.weight`), as transformers writes them; its in-memory fused
`experts.up_proj` is not a module, so PEFT names only the shared expert's projections.
Multi-token-prediction layers (`mtp.*`, Nemotron 3) are skipped on import with a one-line
message, as DeepSeek's are.
"""

import math
from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import LLAMA_BLOCK, Family, need, refuse, rows
from eqllm.families.mamba2 import gguf_refuses_mamba2, step_limit

PREFIX = "backbone."
# config.json's layer names (transformers 5's, then the older spellings) -> eqllm's kinds.
KINDS = {
    "linear_attention": "linear",
    "full_attention": "full",
    "mlp": "ffn",
    "mamba": "linear",
    "attention": "full",
}
SYMBOLS = {"M": "linear", "*": "full", "-": "ffn"}
HF_NAMES = {"linear": "linear_attention", "full": "full_attention", "ffn": "mlp"}
EXPERT_LAYERS = ("moe", "E")  # the names of a mixture-of-experts layer: an "ffn" one with `moe`


def _table() -> tuple:
    layer = PREFIX + "layers.{i}."
    mixer = layer + "mixer."
    mamba = "linear_blocks.attn."
    return (
        *rows(
            (f"{PREFIX}embeddings.weight", "embed.weight"),
            (f"{layer}norm.weight", "linear_blocks.attn_norm.weight"),
            (f"{mixer}conv1d.bias", f"{mamba}conv_bias"),
            (f"{mixer}dt_bias", f"{mamba}dt_bias"),
            (f"{mixer}A_log", f"{mamba}A_log"),
            (f"{mixer}D", f"{mamba}D"),
            (f"{mixer}norm.weight", f"{mamba}norm.weight"),
            (f"{mixer}out_proj.weight", f"{mamba}out_proj.weight"),
        ),
        # in_proj stacks z, x, B, C and dt, in that order.
        *rows(
            (
                f"{mixer}in_proj.weight",
                tuple(f"{mamba}{p}_proj.weight" for p in ("z", "x", "B", "C", "dt")),
            )
        ),
        *rows((f"{mixer}conv1d.weight", f"{mamba}conv_weight"), depthwise=True),
        *rows(
            (f"{layer}norm.weight", "blocks.attn_norm.weight"),
            *((f"{mixer}{p}_proj.weight", f"blocks.attn.{p}_proj.weight") for p in "qkvo"),
        ),
        *rows((f"{layer}norm.weight", "ffn_blocks.mlp_norm.weight")),
        *rows(
            (f"{mixer}up_proj.weight", "ffn_blocks.mlp.up.weight"),
            (f"{mixer}up_proj.bias", "ffn_blocks.mlp.up.bias"),
            (f"{mixer}down_proj.weight", "ffn_blocks.mlp.down.weight"),
            (f"{mixer}down_proj.bias", "ffn_blocks.mlp.down.bias"),
            experts=False,
        ),
        *rows(
            (f"{mixer}shared_experts.up_proj.weight", "ffn_blocks.mlp.shared.up.weight"),
            (f"{mixer}shared_experts.down_proj.weight", "ffn_blocks.mlp.shared.down.weight"),
            (f"{mixer}gate.e_score_correction_bias", "ffn_blocks.mlp.score_bias"),
            experts=True,
        ),
        # transformers' router and fused experts are no nn.Linear: PEFT cannot name them.
        *rows(
            (f"{mixer}gate.weight", "ffn_blocks.mlp.router.weight"),
            (f"{mixer}experts.{{j}}.up_proj.weight", "ffn_blocks.mlp.up.weight"),
            (f"{mixer}experts.{{j}}.down_proj.weight", "ffn_blocks.mlp.down.weight"),
            experts=True,
            module=False,
        ),
        *rows(
            (f"{PREFIX}norm_f.weight", "final_norm.weight"), ("lm_head.weight", "lm_head.weight")
        ),
    )


TABLE = _table()
# transformers loads `backbone.*` as `model.*` (its conversion mapping), so PEFT adapters name
# the modules under `model.`.
RENAMES = {
    r.hf.removesuffix(".weight"): "model." + r.hf.removeprefix(PREFIX).removesuffix(".weight")
    for r in TABLE
    if r.hf.startswith(PREFIX) and r.hf.endswith(".weight")
}


def pattern_from_hf(hf: dict[str, Any]) -> tuple[str, ...]:
    """The eqllm kind of each layer, from whichever spelling of the pattern config.json has
    (an expert layer is an "ffn" one: `has_experts` says which the "ffn" layers are)."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is not None:
        names, given = KINDS, list(types)
    elif hf.get("hybrid_override_pattern") is not None:
        names, given = SYMBOLS, list(hf["hybrid_override_pattern"])
    else:
        raise ConfigError(
            "config.json of a nemotron_h model must set layers_block_type (or "
            "hybrid_override_pattern): the kind of each layer"
        )
    if any(t in EXPERT_LAYERS for t in given) and any(names.get(t) == "ffn" for t in given):
        raise ConfigError(
            "config.json layers_block_type has both 'mlp' and 'moe' layers; eqllm's nemotron_h "
            "has feed-forward layers of one kind per model: all MLP or all experts"
        )
    names = {**names, **dict.fromkeys(EXPERT_LAYERS, "ffn")}
    unknown = sorted({t for t in given if t not in names})
    if unknown:
        raise ConfigError(
            f"config.json layer types {unknown} are not Nemotron-H's; eqllm reads {sorted(names)}"
        )
    return tuple(names[t] for t in given)


def shortest(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest pattern that, repeated a whole number of times, gives `kinds` (a zoo
    variant's `linear.pattern`, as it lists it)."""
    n = len(kinds)
    return kinds[: next(p for p in range(1, n + 1) if n % p == 0 and kinds[: n - p] == kinds[p:])]


def has_experts(hf: dict[str, Any]) -> bool:
    """Whether config.json's feed-forward layers are mixtures of experts ("moe" / "E")."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    given = types if types is not None else hf.get("hybrid_override_pattern") or ()
    return any(t in EXPERT_LAYERS for t in given)


def experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's expert keys (transformers' defaults' values without experts)."""
    moe = cfg.moe
    if moe is None:
        return {}
    return {
        "n_routed_experts": moe.n_experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": cfg.expert_d_ff,
        "moe_shared_expert_intermediate_size": moe.shared_d_ff,
        "num_experts_per_tok": moe.experts_per_token,
        "routed_scaling_factor": moe.routed_scale,
        "n_group": moe.n_groups or 1,
        "topk_group": moe.topk_groups or 1,
        "norm_topk_prob": moe.norm_topk_prob,
    }


def experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `moe` group of a config.json with expert layers (transformers' defaults where a key
    is left out); one group (n_group 1) is no group limit."""
    refuse(hf, "n_shared_experts", (1, None))  # transformers builds one shared expert always
    groups = hf.get("n_group", 1)
    n_experts = hf.get("n_routed_experts", hf.get("num_local_experts", 8))
    return {
        "n_experts": n_experts,
        "experts_per_token": hf.get("num_experts_per_tok", 2),
        "d_ff": hf.get("moe_intermediate_size", 7688),
        "shared_d_ff": hf.get("moe_shared_expert_intermediate_size", 7688),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "n_groups": None if groups == 1 else groups,
        "topk_groups": None if groups == 1 else hf.get("topk_group", 1),
        **EXPERTS,
    }


# The experts' settings transformers' NemotronHMoE fixes (`check` holds a config to them).
EXPERTS = {
    "activation": "relu2",
    "bias": False,
    "shared_gated": False,
    "scoring": "sigmoid",
    "score_bias": True,
    "group_score": "top2_sum",
    "dense_layers": 0,
    "sparse_every": 1,
    "score_input": False,
}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    lin, a = cfg.linear, cfg.attention
    names = {**HF_NAMES, "ffn": "moe"} if cfg.moe is not None else HF_NAMES
    return {
        **experts_to_hf(cfg),
        "hidden_size": cfg.d_model,
        "layers_block_type": [names[k] for k in cfg.layer_kinds()],
        "intermediate_size": cfg.mlp.d_ff,
        "mlp_hidden_act": "relu2",
        "mlp_bias": cfg.mlp.bias,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": cfg.head_dim,
        "attention_bias": False,
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norms.eps,
        "mamba_num_heads": lin.n_value_heads,
        "mamba_head_dim": lin.value_head_dim,
        "ssm_state_size": lin.key_head_dim,
        "n_groups": lin.n_key_heads,
        "conv_kernel": lin.conv_kernel,
        "chunk_size": lin.chunk_size,
        "time_step_limit": [lin.dt_min, math.inf if lin.dt_max is None else lin.dt_max],
        "mamba_hidden_act": "silu",
        "mamba_ssm_cache_dtype": "float32",
        "use_bias": False,
        "use_conv_bias": True,
        "residual_in_fp32": False,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    for key, allowed in (
        ("mlp_hidden_act", ("relu2",)),
        ("mamba_hidden_act", ("silu",)),
        ("use_bias", (False,)),
        ("mamba_proj_bias", (False,)),
        ("use_conv_bias", (True,)),
        ("attention_bias", (False,)),
        ("sliding_window", (None,)),
        ("mamba_ssm_cache_dtype", ("float32",)),
        ("moe_latent_size", (None,)),
    ):
        refuse(hf, key, allowed)
    kinds = pattern_from_hf(hf)
    if has_experts(hf):
        refuse(hf, "mlp_bias", (False,))  # the shared expert's biases: not in eqllm's MoE
    experts = {"moe": experts_from_hf(hf)} if has_experts(hf) else {}
    d, heads = need(hf, "hidden_size"), hf.get("num_attention_heads", 32)
    low, high = (step_limit(v) for v in hf.get("time_step_limit", (0.0, math.inf)))
    return {
        **experts,
        "vocab_size": need(hf, "vocab_size"),
        "d_model": d,
        "n_layers": len(kinds),
        "max_seq_len": hf.get("max_position_embeddings", 4096),
        "norms.eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention.n_heads": heads,
        "attention.n_kv_heads": hf.get("num_key_value_heads") or heads,
        # Nemotron-H's first releases name it attention_head_dim (their remote code's name).
        "attention.head_dim": hf.get("head_dim") or hf.get("attention_head_dim") or 128,
        "mlp.d_ff": hf.get("intermediate_size", 21504),
        "mlp.bias": bool(hf.get("mlp_bias", False)),
        "linear": {
            "kind": "mamba2",
            "pattern": shortest(kinds),
            "mlp": False,
            "full_mlp": False,
            "n_key_heads": hf.get("n_groups", 8),
            "n_value_heads": hf.get("mamba_num_heads", 128),
            "key_head_dim": hf.get("ssm_state_size", 128),
            "value_head_dim": hf.get("mamba_head_dim", 64),
            "conv_kernel": hf.get("conv_kernel", 4),
            "chunk_size": hf.get("chunk_size", 128),
            "dt_min": low,
            "dt_max": None if math.isinf(high) else high,
        },
    }


def check(cfg: ModelConfig) -> dict[str, Any]:
    """Every layer is one sublayer: the pattern's kinds are Nemotron-H's three; experts are
    Nemotron 3's (`EXPERTS`), with a shared expert and no bias on the MLP."""
    lin = cfg.linear
    if lin is None or lin.pattern is None or lin.full_every is not None:
        return {"linear.pattern": None if lin is None else lin.pattern}
    if cfg.moe is None:
        return {}
    bad = {f"moe.{k}": cfg.at(f"moe.{k}") for k, v in EXPERTS.items() if cfg.at(f"moe.{k}") != v}
    if cfg.moe.shared_d_ff is None:
        bad["moe.shared_d_ff"] = None
    if cfg.mlp.bias:
        bad["mlp.bias"] = True
    return bad


def gguf_refuses(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's nemotron_h runs Mamba-2 as its mamba2 does (`gguf_refuses_mamba2`); a model
    with experts is written as its nemotron_h_moe (`eqllm.hub.gguf_hybrid.EXPERTS_ARCH`)."""
    return gguf_refuses_mamba2(cfg.linear)


# config.json keys of the mixture-of-experts layers and multi-token prediction that transformers
# writes for every Nemotron-H (its config class's defaults); without "moe" layers they mean
# nothing, and with them `experts_from_hf` reads them.
UNUSED_MOE_KEYS = """
    n_routed_experts n_shared_experts moe_intermediate_size moe_shared_expert_intermediate_size
    moe_shared_expert_overlap num_experts_per_tok routed_scaling_factor n_group topk_group
    norm_topk_prob output_router_logits num_nextn_predict_layers mtp_layers_block_type
    mtp_hybrid_override_pattern moe_latent_size num_local_experts
"""

FAMILY = Family(
    name="nemotron_h",
    released="2025-04",
    architecture="NemotronHForCausalLM",
    model_type="nemotron_h",
    fixed={
        **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("linear", "moe")},  # `check`: moe
        "positions.kind": "none",
        "mlp.kind": "relu2",
        "linear.kind": "mamba2",
        "linear.full_every": None,
        "linear.mlp": False,
        "linear.full_mlp": False,
        "linear.gate_norm": "after_gate",
        "linear.parallel": False,
        "linear.pre_norm": False,
        "attention.qkv_bias": False,
        "attention.out_bias": False,
        "attention.sliding_window": None,
    },
    table=TABLE,
    prefix=PREFIX,
    hf_keys=frozenset(
        (
            """
        hidden_size num_hidden_layers layers_block_type layer_types hybrid_override_pattern
        intermediate_size mlp_hidden_act mlp_bias num_attention_heads num_key_value_heads
        head_dim attention_head_dim attention_bias max_position_embeddings layer_norm_epsilon
        rms_norm_eps norm_eps mamba_num_heads mamba_head_dim ssm_state_size n_groups conv_kernel
        chunk_size time_step_limit mamba_hidden_act mamba_ssm_cache_dtype use_bias
        mamba_proj_bias use_conv_bias residual_in_fp32 rescale_prenorm_residual expand
        time_step_min time_step_max time_step_floor time_step_rank use_mamba_kernels
        num_logits_to_keep hidden_dropout sliding_window rope_theta partial_rotary_factor
        auto_map
        """
            + UNUSED_MOE_KEYS
        ).split()
    ),
    to_hf=to_hf,
    from_hf=from_hf,
    check=check,
    ignored=r"(backbone\.)?mtp\.",
    module_renames=RENAMES,
    gguf="nemotron_h",
    gguf_refuses=gguf_refuses,
)
