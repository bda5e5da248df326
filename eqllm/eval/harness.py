"""Evaluation harness: validation loss, perplexity, bits per byte, a unigram baseline, samples.

Bits per byte make runs with different tokenizers comparable:
``bpb = loss_nats_per_token / ln 2 / bytes_per_token``, where bytes per token is the split's
UTF-8 bytes over its tokens (eot tokens included), from the prepared `TokenData`. The baseline
is a unigram model of the training split's token frequencies (add-one smoothed) scored on the
same validation tokens: a model that learned anything beyond token frequencies beats it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.data import Tokenizer, eval_batches
from eqllm.model import CausalLM
from eqllm.train.guards import check_token_range, trace_without_runtime_checks
from eqllm.train.step import token_nll


@eqx.filter_jit
@trace_without_runtime_checks  # ids are checked on the host: keeps it in the compile cache
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
        raise ValueError("no tokens were evaluated: the token array is too short")
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


# Sampling -------------------------------------------------------------------------------------


@eqx.filter_jit
def _sample_next(
    model: CausalLM,
    buffers: Int[Array, "prompts window"],
    last: Int[Array, " prompts"],
    key: PRNGKeyArray,
    temperature: Float[Array, ""],
    top_k: int,
) -> Int[Array, " prompts"]:
    logits = jax.vmap(model)(buffers)  # (prompts, window, vocab), causal: padding after `last`
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def naive_sample(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    temperature: float = 0.8,
    top_k: int = 0,
    window: int | None = None,
) -> list[str]:
    """Continue each prompt by `max_new_tokens` tokens; returns prompt + continuation texts.

    A simple, correct sampler without a KV cache: every new token runs the model over a fixed
    buffer of `window` tokens (default: the context length), sliding it once full. Generation
    stops early for a prompt at the end-of-text token. `eqllm.generate` (KV cache) is the fast
    path for long generations; this one is for short report samples.
    """
    cfg = model.config
    window = min(window or cfg.max_seq_len, cfg.max_seq_len)
    top_k = min(top_k, cfg.vocab_size)
    encoded = [tokenizer.encode(p)[-(window - 1) :] or [tokenizer.eot_id] for p in prompts]
    buffers = np.zeros((len(prompts), window), np.int32)
    lengths = np.array([len(e) for e in encoded])
    for i, ids in enumerate(encoded):
        buffers[i, : len(ids)] = ids
    generated: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    temperature_arr = jnp.asarray(temperature, jnp.float32)
    for t in range(max_new_tokens):
        nxt = np.asarray(
            _sample_next(
                model,
                jnp.asarray(buffers),
                jnp.asarray(lengths - 1),
                jax.random.fold_in(key, t),
                temperature_arr,
                top_k,
            )
        )
        for i in range(len(prompts)):
            if done[i]:
                continue
            if nxt[i] == tokenizer.eot_id:
                done[i] = True
                continue
            generated[i].append(int(nxt[i]))
            if lengths[i] == window:  # slide the window by one token
                buffers[i, :-1] = buffers[i, 1:]
                lengths[i] -= 1
            buffers[i, lengths[i]] = nxt[i]
            lengths[i] += 1
        if done.all():
            break
    return [p + tokenizer.decode(g) for p, g in zip(prompts, generated, strict=True)]
