"""Validation loss, perplexity, bits per byte, a unigram baseline, samples, over token data.

Bits per byte make runs with different tokenizers comparable:
``bpb = loss_nats_per_token / ln 2 / bytes_per_token``, where bytes per token is the split's
UTF-8 bytes over its tokens (eot tokens included), from the prepared `TokenData`. The baseline
is a unigram model of the training split's token frequencies (add-one smoothed) scored on the
same validation tokens: a model that learned anything beyond token frequencies beats it.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqllm.data import DataError, eval_batches
from eqllm.eval.loss import check_token_range, token_nll
from eqllm.model import CausalLM


@eqx.filter_jit  # ids are checked on the host (check_token_range) before each call
def _nll_sum(
    model: CausalLM, batch: Int[Array, "batch window"], mask: Bool[Array, "batch window-1"]
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    nll = token_nll(model, batch)
    return jnp.sum(jnp.where(mask, nll, 0.0)), mask.sum()


def evaluate_tokens(
    model: CausalLM,
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
) -> tuple[float, int]:
    """(mean loss in nats per target, number of targets) over consecutive windows of `tokens`.

    Covers the whole array unless `max_batches` (then its first batches). One compile per
    (batch_size, seq_len): the last batch is padded and masked.
    """
    total, count = 0.0, 0
    for batch, mask in eval_batches(
        tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches
    ):
        check_token_range(batch, model.config.vocab_size)
        s, n = _nll_sum(model, jnp.asarray(batch), jnp.asarray(mask))
        total += float(s)
        count += int(n)
    if count == 0:
        raise DataError(
            f"no tokens were evaluated: the token array holds {len(tokens)} tokens, fewer than "
            f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or more data"
        )
    return total / count, count


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Bits per UTF-8 byte from a mean loss in nats per token."""
    return loss_nats / math.log(2) / bytes_per_token


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross entropy (nats/token) on `val` of the add-one smoothed unigram model of `train`."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    val_counts = np.bincount(np.asarray(val[1:]), minlength=vocab_size)
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def loss_report(loss: float, bytes_per_token: float) -> dict[str, float]:
    """loss, perplexity and bits per byte from a mean loss in nats per token."""
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bpb": bits_per_byte(loss, bytes_per_token),
    }
