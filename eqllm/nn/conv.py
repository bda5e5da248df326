"""The short depthwise causal convolution that the linear-attention layers (Gated DeltaNet,
Mamba-2) run over their inputs before the recurrence, with a carried window of past inputs so
a sequence may continue across calls (chunked prefill, decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def causal_conv(
    x: Float[Array, "seq channels"],
    weight: Float[Array, "channels kernel"],
    past: Float[Array, "conv_width channels"],
    reset: Bool[Array, " seq"],
    bias: Float[Array, " channels"] | None = None,
) -> tuple[Float[Array, "seq channels"], Float[Array, "conv_width channels"]]:
    """SiLU of the depthwise causal convolution of `x` after its `past` inputs (kernel - 1 rows).

    weight[:, -1] multiplies the current token, as torch's `Conv1d` with left padding; `bias`
    (None: none) is added before the SiLU (Mamba-2's conv). Inputs from before a reset are left
    out. Returns the outputs and the last kernel - 1 inputs (those
    of the last document only) for the next call.
    """
    seq, width = x.shape[0], weight.shape[-1] - 1
    rows = jnp.concatenate([past.astype(x.dtype), x])  # (width + seq, channels)
    doc = jnp.concatenate([jnp.zeros(width, jnp.int32), jnp.cumsum(reset, dtype=jnp.int32)])
    w = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    for j in range(width + 1):  # a few taps: the kernel's width, not the sequence
        tap = jnp.where((doc[j : j + seq] == doc[width:])[:, None], rows[j : j + seq], 0)
        y = y + tap.astype(jnp.float32) * w[:, j]
    kept = jnp.where((doc[seq:] == doc[-1])[:, None], rows[seq:], 0)
    return jax.nn.silu(y).astype(x.dtype), kept.astype(past.dtype)


def behind_padding(x, past, valid):
    """`x` left-padded (`valid` False first) and `past` rearranged into (x', past') whose
    concatenation is zeros for the padding, `past`, then the real tokens: the convolution then
    sees each real token after the true past (all padding keeps `past`)."""
    width, seq = past.shape[0], x.shape[0]
    pad = seq - jnp.sum(valid)
    rows = jnp.concatenate([past.astype(x.dtype), x])  # (width + seq, channels)
    i = jnp.arange(width + seq)
    source = jnp.where(i < pad + width, i - pad, i)
    moved = jnp.where((i >= pad)[:, None], rows[jnp.clip(source, 0, width + seq - 1)], 0)
    return moved[width:], moved[:width].astype(past.dtype)
