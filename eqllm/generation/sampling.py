"""Sampling: settings held as arrays, transformers' filters (top-k, top-p, min-p), CTRL's
repetition penalty, and the choice of one next token."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.errors import EqllmError


class GenerationError(EqllmError):
    """A bad prompt, key or generation setting."""


class Sampling(eqx.Module):
    """Sampling settings held as arrays, so that changing them does not recompile.

    Build it with `sampling(...)`, which validates. Off values: top_k 0, top_p 1, min_p 0,
    repetition_penalty 1. temperature 0 is greedy decoding.
    """

    temperature: Float[Array, ""]
    top_k: Int[Array, ""]
    top_p: Float[Array, ""]
    min_p: Float[Array, ""]
    repetition_penalty: Float[Array, ""]


def sampling(
    temperature: float | int = 1.0,
    top_k: int | None = None,
    top_p: float | int | None = None,
    min_p: float | int | None = None,
    repetition_penalty: float | int | None = None,
) -> Sampling:
    """Validated sampling settings (None switches a filter off); GenerationError if invalid."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerationError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise GenerationError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise GenerationError(f"top_p must lie in (0, 1] (None: off), got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise GenerationError(f"min_p must lie in [0, 1] (None: off), got {min_p}")
    if repetition_penalty is not None and not (
        math.isfinite(repetition_penalty) and repetition_penalty > 0
    ):
        raise GenerationError(
            f"repetition_penalty must be a finite number > 0 (1: off), got {repetition_penalty}"
        )
    return Sampling(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_k=jnp.asarray(0 if top_k is None else top_k, jnp.int32),
        top_p=jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        min_p=jnp.asarray(0.0 if min_p is None else min_p, jnp.float32),
        repetition_penalty=jnp.asarray(
            1.0 if repetition_penalty is None else repetition_penalty, jnp.float32
        ),
    )


def filter_logits(logits: Float[Array, " vocab"], settings: Sampling) -> Float[Array, " vocab"]:
    """Temperature-scaled fp32 logits with every token outside the allowed set at -inf.

    Filters in transformers' order: top-k, then top-p (the smallest set of most likely tokens
    whose probability reaches top_p, renormalised after top-k; the most likely token is always
    kept), then min-p (tokens at least min_p times as likely as the most likely one). Tokens
    tied with the last one kept are kept too.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.maximum(settings.temperature, 1e-6)

    def restrict(scaled):
        ordered = jnp.sort(scaled)[::-1]  # descending
        rank = jnp.arange(vocab)
        k = jnp.where(settings.top_k > 0, jnp.minimum(settings.top_k, vocab), vocab)
        in_top_k = rank < k
        probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf))
        before = jnp.cumsum(probs) - probs  # probability of the strictly more likely tokens
        kept = in_top_k & (before < settings.top_p)
        kept = kept | (rank == 0)
        threshold = ordered[jnp.sum(kept) - 1]
        floor = ordered[0] + jnp.log(settings.min_p)  # p_i >= min_p * p_max, in logit space
        allowed = (scaled >= threshold) & (scaled >= floor)
        return jnp.where(allowed, scaled, -jnp.inf)

    active = (settings.top_k > 0) | (settings.top_p < 1) | (settings.min_p > 0)
    return jax.lax.cond(active, restrict, lambda s: s, scaled)


def penalize_repetition(
    logits: Float[Array, " vocab"], present: Bool[Array, " vocab"], penalty: Float[Array, ""]
) -> Float[Array, " vocab"]:
    """CTRL's repetition penalty: logits of tokens already present are divided by `penalty`
    when positive and multiplied by it when negative (Keskar et al., 2019)."""
    logits = logits.astype(jnp.float32)
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(present, penalized, logits)


def sample_token(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray,
    present: Bool[Array, " vocab"],
    settings: Sampling,
) -> Int[Array, ""]:
    """One next token: repetition penalty, then argmax (temperature 0) or a filtered sample."""
    logits = penalize_repetition(logits, present, settings.repetition_penalty)
    greedy = jnp.argmax(logits)
    sampled = jax.random.categorical(key, filter_logits(logits, settings))
    return jnp.where(settings.temperature == 0, greedy, sampled).astype(jnp.int32)
