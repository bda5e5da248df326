"""The flat ModelConfig of earlier eqllm versions, read into today's groups.

Run folders and eqllm model folders written before the config was grouped hold a flat
`config.json`/`config.toml` (`n_heads`, `rope_theta`, `n_experts`, ...); `ModelConfig.from_dict`
passes every dict through `from_flat`, so they keep loading.
"""

from __future__ import annotations

from typing import Any

# The flat ModelConfig fields of earlier versions and the dotted paths that hold them now.
FLAT_NAMES = {
    **{f: f"attention.{f}" for f in ("n_heads", "n_kv_heads", "head_dim", "qkv_bias", "out_bias")},
    **{f: f"attention.{f}" for f in ("sliding_window", "global_every", "query_pre_attn_scalar")},
    "attn_softcap": "attention.softcap",
    "position": "positions.kind",
    "rope_theta": "positions.theta",
    "rope_local_theta": "positions.local_theta",
    "rope_fraction": "positions.fraction",
    "rope_factor": "positions.scaling.factor",
    "rope_low_freq_factor": "positions.scaling.low_freq_factor",
    "rope_high_freq_factor": "positions.scaling.high_freq_factor",
    "rope_original_max_seq_len": "positions.scaling.original_max_seq_len",
    "d_ff": "mlp.d_ff",
    "mlp_bias": "mlp.bias",
    "n_experts": "moe.n_experts",
    "experts_per_token": "moe.experts_per_token",
    "moe_d_ff": "moe.d_ff",
    "norm_topk_prob": "moe.norm_topk_prob",
    "shared_expert_d_ff": "moe.shared_d_ff",
    "router_aux_loss_coef": "moe.aux_loss_coef",
    "moe_impl": "moe.impl",
    "norm": "norms.kind",
    "norm_eps": "norms.eps",
    "norm_plus_one": "norms.plus_one",
    "norm_bias": "norms.bias",
    "pre_norms": "norms.pre",
    "post_norms": "norms.post",
}


def from_flat(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict of the earlier flat layout in today's dotted paths (others unchanged)."""
    if "n_heads" not in values or isinstance(values.get("attention"), dict):
        return values
    flat = dict(values)
    out = {"attention.kernel": flat.pop("attention", "auto")}
    qk_norm, per_head = flat.pop("qk_norm", False), flat.pop("qk_norm_per_head", True)
    out["attention.qk_norm"] = ("head" if per_head else "whole") if qk_norm else None
    scaled = flat.pop("rope_scaling", "none") != "none"
    if scaled:
        out["positions.scaling.kind"] = "llama3"
    experts = flat.get("n_experts") is not None
    impl = flat.pop("moe_impl", "dense")
    for key, value in flat.items():
        path = FLAT_NAMES.get(key, key)
        if (path.startswith("positions.scaling.") and not scaled) or (
            path.startswith("moe.") and not experts
        ):
            continue
        out[path] = value
    if experts:
        out["moe.impl"] = impl
    else:
        out["moe"] = None
    return out
