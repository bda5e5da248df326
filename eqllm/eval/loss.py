"""Next-token losses and the host-side check of token ids that precedes every compiled call.

`token_nll` and `mean_loss` are what training minimises and evaluation reports; they live below
both (`eqllm.train` imports `eqllm.eval`, never the reverse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm.data import DataError
from eqllm.model import CausalLM


def token_nll(model: CausalLM, batch: Int[Array, "batch window"]) -> Float[Array, "batch window-1"]:
    """Negative log-likelihood (nats, fp32) of every target `batch[:, 1:]` given its prefix."""
    logits = model(batch[:, :-1])  # (batch, seq, vocab), fp32
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])


def mean_loss(
    model: CausalLM,
    batch: Int[Array, "batch window"],
    mask: Bool[Array, "batch window-1"] | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross entropy over the (masked-in) targets."""
    return masked_mean(token_nll(model, batch), mask)


def masked_mean(
    nll: Float[Array, "*targets"], mask: Bool[Array, "*targets"] | None
) -> Float[Array, ""]:
    """The mean of per-target losses over the masked-in targets (all of them without a mask)."""
    if mask is None:
        return nll.mean()
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(mask.sum(), 1)


def check_token_range(batch, vocab_size: int) -> None:
    """Raise `DataError` unless a concrete batch is 2-D integer ids in [0, vocab_size).

    Checked on the host before a compiled step or evaluation, so the compiled code needs no
    runtime check (whose host callback would keep it out of JAX's persistent compile cache).
    Tracers pass unchecked.
    """
    if isinstance(batch, jax.core.Tracer):
        return
    if np.ndim(batch) != 2 or not jnp.issubdtype(batch.dtype, jnp.integer):
        raise DataError(
            f"a training batch must be a 2-D integer array (sequences, tokens), got shape "
            f"{np.shape(batch)} and dtype {batch.dtype}"
        )
    lo, hi = (int(v) for v in jax.device_get((batch.min(), batch.max())))
    if lo < 0 or hi >= vocab_size:
        raise DataError(
            f"token id out of range: the batch holds ids in [{lo}, {hi}] but the model's "
            f"vocab_size is {vocab_size}; use the tokenizer the model was built for, or a "
            "model with a larger vocab_size"
        )
