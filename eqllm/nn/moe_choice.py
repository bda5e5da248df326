"""DeepSeek's expert selection (`eqllm.nn.MoE` with sigmoid scores, a correction bias or
groups of experts): scores, plus the correction bias to choose, limited to the best groups; the
weights are the scores of the chosen experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def limited_choice(
    logits: Float[Array, "rows experts"],
    top_k: int,
    *,
    scoring: str,
    score_bias: Float[Array, " experts"] | None,
    n_groups: int | None,
    topk_groups: int | None,
    group_score: str,
    normalize: bool,
) -> tuple[Float[Array, "rows k"], Int[Array, "rows k"]]:
    """(weights, experts) of each row: the top `top_k` of the scores (softmax or sigmoid of the
    fp32 `logits`) plus `score_bias`, among the `topk_groups` best of `n_groups` groups (each
    scored by its "max" or "top2_sum"); weights renormalised where `normalize`."""
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores
    if score_bias is not None:
        choice = choice + jax.lax.stop_gradient(score_bias.astype(jnp.float32))
    if n_groups is not None:
        grouped = choice.reshape(*choice.shape[:-1], n_groups, -1)  # (T, groups, E/G)
        if group_score == "max":
            group = grouped.max(-1)
        else:
            group = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, best = jax.lax.top_k(group, topk_groups)
        keep = jax.nn.one_hot(best, n_groups, dtype=jnp.bool_).any(-2)  # (T, groups)
        keep = jnp.broadcast_to(keep[..., None], grouped.shape).reshape(choice.shape)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, experts = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights, experts
