"""What the mixture-of-experts families share: the Llama attention rows without the MLP, the
router and expert rows of both checkpoint layouts, and the routing keys of config.json."""

from __future__ import annotations

from typing import Any

from eqllm.config import ModelConfig
from eqllm.families.base import LLAMA_TABLE, Row, rows

# Mixture of experts: the attention rows of the Llama table, and the expert rows of both layouts.

MOE_ATTENTION_TABLE = tuple(r for r in LLAMA_TABLE if ".mlp." not in r.hf)
MOE_KEYS = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})


def expert_rows(moe: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """The router and per-expert rows of a sparse MLP named `moe` ("model.layers.{i}.mlp"), as
    published checkpoints and transformers' save_pretrained store them: one tensor per expert."""
    return rows(
        (f"{moe}.gate.weight", "blocks.mlp.router.weight"),
        (f"{moe}.experts.{{j}}.{gate}.weight", "blocks.mlp.gate.weight"),
        (f"{moe}.experts.{{j}}.{up}.weight", "blocks.mlp.up.weight"),
        (f"{moe}.experts.{{j}}.{down}.weight", "blocks.mlp.down.weight"),
    )


# transformers 5's in-memory layout: the experts fused, gate_up_proj [E, 2 d_ff, d_model] (gate
# rows, then up rows) and down_proj [E, d_model, d_ff].
FUSED_EXPERT_ROWS = rows(
    ("model.layers.{i}.mlp.gate.weight", "blocks.mlp.router.weight"),
    ("model.layers.{i}.mlp.experts.down_proj", "blocks.mlp.down.weight"),
) + rows(
    (
        "model.layers.{i}.mlp.experts.gate_up_proj",
        ("blocks.mlp.gate.weight", "blocks.mlp.up.weight"),
    ),
    axis=1,
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
