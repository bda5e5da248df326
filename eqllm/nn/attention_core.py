"""The attention core: softmax(q k^T) v over grouped-query heads with a mask
(`dot_product_attention`), and causal attention of positions in order that skips the key blocks
the mask would zero (`in_order_attention`). `eqllm.nn.attention` builds the layer on them."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqllm.nn.mask import attention_mask


def dot_product_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    mask: Bool[Array, "*#batch seq kv_seq"],
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """softmax(cap(q k^T * scale) + mask) v, query heads grouped over the shared kv heads.

    `scale` defaults to 1 / sqrt(head_dim); `softcap` (None: off) bounds the scores to
    (-softcap, softcap) by softcap * tanh(s / softcap), before the mask. `sinks` (None: none)
    are attention sinks, one learned logit per query head (gpt-oss): each joins its head's
    softmax denominator as one more key that takes probability mass and carries no value, so
    a row's weights sum to less than 1.
    `mask` broadcasts over the leading axes (one (seq, kv_seq) mask serves a whole batch).
    Scores and softmax are in fp32 whatever the input dtype. A query row with no allowed key
    returns zeros (it only occurs for padding).
    """
    *batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[-2]
    # (..., seq, kv_heads, groups, head_dim): query heads that share one kv head sit together.
    q = q.reshape(*batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("...tkgd,...skd->...kgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = mask[..., None, None, :, :]  # broadcast over (kv_heads, groups)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        # (kv_heads, groups, 1, 1): query head h = kv * groups + g, as q was reshaped above.
        sink = sinks.astype(jnp.float32).reshape(kv_heads, heads // kv_heads, 1, 1)
        top = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
        e = jnp.exp(scores - top)  # masked scores underflow to 0
        probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))
    probs = jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)  # fully masked rows -> 0
    out = jnp.einsum("...kgts,...skd->...tkgd", probs.astype(v.dtype), v)
    return out.reshape(*batch, seq, heads, head_dim)


def in_order_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    sliding_window: int | None = None,
    chunks: int = 4,
    *,
    local: Bool[Array, ""] | bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    sinks: Float[Array, " heads"] | None = None,
    chunk_size: int | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Causal attention of positions 0..seq-1, skipping key blocks the mask would zero anyway.

    The queries are split into up to `chunks` blocks of at least 64 rows; each attends only to
    the keys up to its last row (and from its window's start), so the scores computed fall from
    seq^2 to about (chunks + 1) / (2 * chunks) of it (62.5% at 4). Same values as
    `dot_product_attention` with the causal mask. With a traced `local` flag the window may be
    lifted, so only the causal skipping applies; a Python bool decides it while tracing.
    `segment_ids` (None: one segment) further keep each query to keys of its own segment;
    `sinks` as in `dot_product_attention`; `chunk_size` as in `attention_mask` (its keys are
    masked, not skipped).
    """
    if isinstance(local, bool | np.bool_):  # known when tracing: apply or drop the window now
        sliding_window, chunk_size = (sliding_window, chunk_size) if local else (None, None)
        local = None
    seq = q.shape[-3]
    n = max(1, min(chunks, seq // 64))
    bounds = [seq * i // n for i in range(n + 1)]
    positions = jnp.arange(seq)
    outs = []
    for start, end in itertools.pairwise(bounds):
        windowed = sliding_window is not None and local is None
        first = max(0, start - sliding_window + 1) if windowed else 0
        mask = attention_mask(
            positions[start:end], positions[first:end], sliding_window, local, chunk_size=chunk_size
        )
        if segment_ids is not None:
            same = segment_ids[..., start:end, None] == segment_ids[..., None, first:end]
            mask = mask & same
        keys, values = k[..., first:end, :, :], v[..., first:end, :, :]
        outs.append(
            dot_product_attention(
                q[..., start:end, :, :],
                keys,
                values,
                mask,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
            )
        )
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=-3)
