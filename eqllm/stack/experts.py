"""The mixture-of-experts layer a ModelConfig describes (`make_block`'s feed-forward part)."""

from __future__ import annotations

import jax
from jaxtyping import PRNGKeyArray

from eqllm.config import ModelConfig
from eqllm.config.experts import choose_impl, choose_kernel
from eqllm.nn import MoE


def make_moe(config: ModelConfig, key: PRNGKeyArray, dtype) -> MoE:
    """`config.moe`'s layer, its impl and kernel chosen for this backend on one device."""
    moe, norms = config.moe, config.norms
    # "auto" without a mesh; a run chooses again with its mesh (`with_experts_impl`)
    backend = jax.default_backend()
    impl = choose_impl(moe.impl, backend=backend, expert_shards=1, n_experts=moe.n_experts)[0]
    return MoE(
        config.d_model,
        config.expert_d_ff,
        moe.n_experts,
        moe.experts_per_token,
        normalize=moe.norm_topk_prob,
        shared_d_ff=moe.shared_d_ff,
        impl=impl,
        kernel=choose_kernel(moe.kernel, backend=backend, impl=impl),
        capacity_factor=moe.capacity_factor,
        bias=moe.bias,
        activation=moe.activation,
        swiglu_alpha=moe.swiglu_alpha,
        swiglu_limit=moe.swiglu_limit,
        shared_gated=moe.shared_gated,
        scoring=moe.scoring,
        score_bias=moe.score_bias,
        n_groups=moe.n_groups,
        topk_groups=moe.topk_groups,
        group_score=moe.group_score,
        routed_scale=moe.routed_scale,
        score_input=moe.score_input,
        router_norm=moe.router_norm,
        expert_scale=moe.expert_scale,
        branch_norms=moe.branch_norms,
        norm_eps=norms.eps,
        norm_plus_one=norms.plus_one,
        key=key,
        dtype=dtype,
    )
