"""Segment ids and per-document positions of packed rows (document masking).

A packed row holds several documents; `segment_ids` number them so that attention never
crosses from one into the next (`CausalLM(tokens, positions, segment_ids)`), as Levanter's
segment ids, MaxText's packing segmentation and torchtitan's block-causal mask do.

In pretraining windows, documents are separated by the end-of-text token. The end-of-text token
opens the next document's segment: the last token of a document still predicts the end-of-text
token within its own document, and the end-of-text token then predicts the next document's first
token with no other context, as a beginning-of-sequence token would. Which tokens a step sees is
unchanged; only what each token attends to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


def document_segments(
    tokens: Int[Array, "*batch seq"] | Int[np.ndarray, "*batch seq"], eot: int
) -> Int[Array, "*batch seq"]:
    """Segment id of every token: how many end-of-text tokens `eot` come at or before it."""
    return jnp.cumsum(tokens == eot, axis=-1, dtype=jnp.int32)


def document_positions(
    segment_ids: Int[Array, "*batch seq"] | Int[np.ndarray, "*batch seq"],
) -> Int[Array, "*batch seq"]:
    """Positions that restart at 0 wherever the segment id changes (`data.reset_positions`)."""
    segment_ids = jnp.asarray(segment_ids)
    seq = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    first = jnp.ones((*segment_ids.shape[:-1], 1), bool)
    starts = jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    # The index of the latest segment start at or before each token.
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)
    return index - start_index
