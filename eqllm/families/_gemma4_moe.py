"""Gemma 4's mixture-of-experts block (26B-A4B, `enable_moe_block`), as `eqllm.families.gemma4`
reads and writes it: every layer runs its dense MLP and 128 experts side by side on the same
residual, each branch normed before and after, their sum normed again. In eqllm's terms the dense
MLP is the ungated shared expert (`moe.shared_d_ff` = `mlp.d_ff` = intermediate_size) with
`moe.branch_norms`; the router reads the residual through a weightless RMSNorm and a learned
scale (`moe.router_norm`), softmax over all experts, the top k renormalised, then times a learned
scale per expert (`moe.expert_scale`); the experts are tanh-GELU gated (`moe.activation`
"geglu"), stored fused as transformers 5 holds them (gate_up_proj, down_proj)."""

from __future__ import annotations

import dataclasses
from typing import Any

from eqllm.config import ConfigError, ModelConfig
from eqllm.families.base import PLAIN_EXPERTS, Row, need, rows

# What Gemma 4's experts fix (transformers' Gemma4TextRouter and Gemma4TextExperts).
EXPERTS = {
    **PLAIN_EXPERTS,
    "moe.activation": "geglu",
    "moe.norm_topk_prob": True,
    "moe.shared_gated": False,
    "moe.router_norm": True,
    "moe.expert_scale": True,
    "moe.branch_norms": True,
}
_L = "model.layers.{i}."
_DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "pre_feedforward_layernorm")


def with_experts(table: list[Row]) -> list[Row]:
    """Gemma 4's layer rows (`table`, "model." names) with the experts' rows added: the dense
    MLP and its norm go to the shared expert in a model with experts (`Row.experts`)."""
    dense = [r for r in table if r.hf.removeprefix(_L).rsplit(".", 1)[0] in _DENSE_MLP]
    shared = {"blocks.mlp_norm.weight": "blocks.mlp.shared_norm.weight"}
    moved = [
        dataclasses.replace(
            r,
            eqllm=tuple(
                shared.get(p, p.replace("blocks.mlp.", "blocks.mlp.shared.")) for p in r.eqllm
            ),
            experts=True,
        )
        for r in dense
    ]
    m = "blocks.mlp."
    experts = (
        rows(
            (f"{_L}post_feedforward_layernorm_1.weight", f"{m}shared_post_norm.weight"),
            (f"{_L}pre_feedforward_layernorm_2.weight", f"{m}experts_norm.weight"),
            (f"{_L}post_feedforward_layernorm_2.weight", f"{m}experts_post_norm.weight"),
            (f"{_L}router.proj.weight", f"{m}router.weight"),
            (f"{_L}router.scale", f"{m}router_scale"),
            (f"{_L}router.per_expert_scale", f"{m}expert_scale"),
            experts=True,
        )
        + rows(
            (f"{_L}experts.gate_up_proj", (f"{m}gate.weight", f"{m}up.weight")),
            axis=1,
            experts=True,
            module=False,
        )
        + rows((f"{_L}experts.down_proj", f"{m}down.weight"), experts=True, module=False)
    )
    kept = [dataclasses.replace(r, experts=False) if r in dense else r for r in table]
    return [*kept, *moved, *experts]


def experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The experts' settings of a config.json with `enable_moe_block` (none without)."""
    if not hf.get("enable_moe_block"):
        return {}
    # transformers 5.7 and later also write the experts' size as expert_intermediate_size.
    size = hf.get("moe_intermediate_size") or hf.get("expert_intermediate_size")
    if size is None:
        raise ConfigError(
            "config.json enable_moe_block=True needs moe_intermediate_size (each expert's "
            "hidden size); add it"
        )
    return {
        **EXPERTS,
        "moe.n_experts": need(hf, "num_experts"),
        "moe.experts_per_token": need(hf, "top_k_experts"),
        "moe.d_ff": size,
        "moe.shared_d_ff": need(hf, "intermediate_size"),
    }


def experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's experts keys (enable_moe_block False and no experts for a dense model)."""
    moe = cfg.moe
    if moe is None:
        return {"enable_moe_block": False}
    return {
        "enable_moe_block": True,
        "num_experts": moe.n_experts,
        "top_k_experts": moe.experts_per_token,
        "moe_intermediate_size": cfg.expert_d_ff,
    }


def check_experts(cfg: ModelConfig) -> dict[str, Any]:
    """Settings of a config with experts that config.json cannot say: routing other than
    Gemma 4's, a dense MLP (the shared expert) of another size than mlp.d_ff, no moe.d_ff."""
    moe = cfg.moe
    if moe is None:
        return {}
    bad = {k: cfg.at(k) for k, v in EXPERTS.items() if cfg.at(k) != v}
    if moe.shared_d_ff != cfg.mlp.d_ff:  # one intermediate_size for both
        bad["moe.shared_d_ff"] = moe.shared_d_ff
    if moe.d_ff is None:  # written as moe_intermediate_size, read back as set
        bad["moe.d_ff"] = None
    return bad
