"""What the mixture-of-experts families share: the Llama attention rows without the MLP, the
router and expert rows of both checkpoint layouts, and the routing keys of config.json."""

from __future__ import annotations

from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import LLAMA_TABLE, Row, need, rows

# Mixture of experts: the attention rows of the Llama table, and the expert rows of both layouts.

MOE_ATTENTION_TABLE = tuple(r for r in LLAMA_TABLE if ".mlp." not in r.hf)
MOE_KEYS = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})


def expert_rows(moe: str, gate: str, up: str, down: str, stack: str = "blocks") -> tuple[Row, ...]:
    """The router and per-expert rows of a sparse MLP named `moe` ("model.layers.{i}.mlp"), as
    published checkpoints and transformers' save_pretrained store them: one tensor per expert.
    `stack`: the stack of layers they fill (a hybrid's "linear_blocks" too)."""
    return rows(
        (f"{moe}.gate.weight", f"{stack}.mlp.router.weight"),
        (f"{moe}.experts.{{j}}.{gate}.weight", f"{stack}.mlp.gate.weight"),
        (f"{moe}.experts.{{j}}.{up}.weight", f"{stack}.mlp.up.weight"),
        (f"{moe}.experts.{{j}}.{down}.weight", f"{stack}.mlp.down.weight"),
    )


def fused_expert_rows(moe: str, stack: str = "blocks") -> tuple[Row, ...]:
    """The router and experts of `moe` in transformers 5's in-memory layout: the experts fused,
    gate_up_proj [E, 2 d_ff, d_model] (gate rows, then up rows) and down_proj [E, d_model,
    d_ff]."""
    return rows(
        (f"{moe}.gate.weight", f"{stack}.mlp.router.weight"),
        (f"{moe}.experts.down_proj", f"{stack}.mlp.down.weight"),
    ) + rows(
        (f"{moe}.experts.gate_up_proj", (f"{stack}.mlp.gate.weight", f"{stack}.mlp.up.weight")),
        axis=1,
    )


FUSED_EXPERT_ROWS = fused_expert_rows("model.layers.{i}.mlp")


def shared_expert_rows(moe: str, stack: str = "blocks") -> tuple[Row, ...]:
    """Qwen-MoE's shared expert of `moe` and its sigmoid gate (one output)."""
    return rows(
        *(
            (f"{moe}.shared_expert.{p}_proj.weight", f"{stack}.mlp.shared.{p}.weight")
            for p in ("gate", "up", "down")
        ),
        (f"{moe}.shared_expert_gate.weight", f"{stack}.mlp.shared_gate.weight"),
    )


def moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The routing keys every MoE family's config.json shares."""
    return {
        "num_experts_per_tok": cfg.moe.experts_per_token,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
    }


def moe_from_hf(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """experts_per_token and router_aux_loss_coef from config.json (`defaults`: the family's
    transformers defaults, for keys a config.json leaves out)."""
    hf = {**defaults, **hf}
    return {
        "moe.experts_per_token": hf["num_experts_per_tok"],
        "moe.aux_loss_coef": float(hf["router_aux_loss_coef"]),
    }


def has_experts(cfg: ModelConfig) -> dict[str, Any]:
    """A `check` of the MoE families: a config without experts is not one of theirs."""
    return {"moe": None} if cfg.moe is None else {}


# The experts' keys of the Qwen mixtures' config.json (`qwen_experts_to_hf`).
QWEN_EXPERT_KEYS = frozenset(
    {
        "num_experts",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    }
)


def qwen_experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The experts' keys of the Qwen mixtures' config.json (Qwen2-MoE, Qwen3-Next), experts in
    every layer."""
    return {
        "num_experts": cfg.moe.n_experts,
        "moe_intermediate_size": cfg.expert_d_ff,
        "shared_expert_intermediate_size": cfg.moe.shared_d_ff,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def has_shared_expert(cfg: ModelConfig) -> dict[str, Any]:
    """A `check` of the Qwen mixtures (Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next): experts, and the
    gated shared expert transformers always builds for them."""
    shared = {"moe.shared_d_ff": None} if cfg.at("moe.shared_d_ff") is None else {}
    return {**has_experts(cfg), **shared}


def sparse_everywhere(hf: dict[str, Any], family: str) -> None:
    """Refuse a config.json that gives some layers a dense MLP: eqllm's stacked blocks have one
    MLP kind for all layers. transformers (Qwen3-MoE, Qwen3-Next) puts experts in layer i when
    i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0."""
    n_layers = need(hf, "num_hidden_layers")
    step = hf.get("decoder_sparse_step")
    if step not in (1, None):
        dense = [i for i in range(n_layers) if (i + 1) % step != 0] if step > 0 else "every"
        raise ConfigError(
            f"config.json decoder_sparse_step={step} gives layers {dense} a dense MLP; eqllm's "
            f"{family} has experts in every layer (decoder_sparse_step=1)"
        )
    only = [i for i in hf.get("mlp_only_layers") or () if 0 <= i < n_layers]
    if only:
        raise ConfigError(
            f"config.json mlp_only_layers={list(hf['mlp_only_layers'])} gives layers {only} a "
            f"dense MLP; eqllm's {family} has experts in every layer (mlp_only_layers=[])"
        )
