"""Sampling: settings held as arrays, transformers' filters (top-k, top-p, min-p), CTRL's
repetition penalty, and the choice of one next token."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, UInt32

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


def filter_logits(
    logits: Float[Array, "*rows vocab"], settings: Sampling
) -> Float[Array, "*rows vocab"]:
    """Temperature-scaled fp32 logits with every token outside the allowed set at -inf.

    Filters in transformers' order: top-k, then top-p (the smallest set of most likely tokens
    whose probability reaches top_p, renormalised after top-k; the most likely token is always
    kept), then min-p (tokens at least min_p times as likely as the most likely one). Tokens
    tied with the last one kept are kept too. With leading `rows`, each row has its own
    settings (the settings' arrays have shape `rows`).

    Nothing is sorted: each threshold is found by bisection over the 2^32 fp32 values (32
    counting passes over the vocabulary), since XLA's CPU sort of a 50k vocabulary costs ~10 ms
    a row. A filter no row uses is skipped.
    """
    vocab = logits.shape[-1]
    temperature = jnp.asarray(settings.temperature)[..., None]
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    order = _order_keys(scaled)
    top_k, top_p, min_p = (
        jnp.broadcast_to(v, scaled.shape[:-1])
        for v in (settings.top_k, settings.top_p, settings.min_p)
    )
    allowed = jnp.ones(scaled.shape, bool)

    def kth_largest(allowed):  # keeps every token tied with the k-th largest, as transformers
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        ones = jnp.ones(scaled.shape, jnp.int32)
        return allowed & (order >= _smallest_key(order, ones, k)[..., None])

    def nucleus(allowed):
        probs = jax.nn.softmax(jnp.where(allowed, scaled, -jnp.inf), axis=-1)
        threshold = _smallest_key(order, probs, top_p)[..., None]
        return allowed & ((order >= threshold) | (top_p[..., None] >= 1))

    allowed = jax.lax.cond(jnp.any(top_k > 0), kth_largest, lambda a: a, allowed)
    allowed = jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda a: a, allowed)
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)[..., None]
    allowed = allowed & (scaled >= floor)  # p_i >= min_p * p_max, in logit space
    return jnp.where(allowed, scaled, -jnp.inf)


def _order_keys(x: Float[Array, "*shape"]) -> UInt32[Array, "*shape"]:
    """fp32 values as uint32 keys in the same order (the sign-flip of a radix sort)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _smallest_key(
    keys: UInt32[Array, "*rows vocab"], weights: Array, limit: Array
) -> UInt32[Array, "*rows"]:
    """Per row, the smallest key u among the row's keys such that the weights of the keys
    above u sum to less than `limit` (a key of the row: the sum only changes at one)."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # the sum at the largest key is 0

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(keys > mid[..., None], weights, 0), axis=-1) < limit
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def penalize_repetition(
    logits: Float[Array, "*rows vocab"], present: Bool[Array, "*rows vocab"], penalty: Array
) -> Float[Array, "*rows vocab"]:
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
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # a raw uint32 key
        key = jax.random.wrap_key_data(key)
    return sample_tokens(logits[None], key[None], present[None], settings)[0]


def sample_tokens(
    logits: Float[Array, "rows vocab"],
    keys: Key[Array, " rows"],
    present: Bool[Array, "rows vocab"],
    settings: Sampling,
) -> Int[Array, " rows"]:
    """`sample_token` for each row with its own key (and its own settings, when the settings'
    arrays have shape `rows`); the sampling is skipped when every row is greedy."""
    penalty = jnp.broadcast_to(settings.repetition_penalty, logits.shape[:-1])[..., None]
    logits = penalize_repetition(logits, present, penalty)
    greedy = jnp.argmax(logits, axis=-1)

    def sample(_):
        filtered = filter_logits(logits, settings)
        return jax.vmap(_draw)(keys, filtered).astype(greedy.dtype)

    sampled = jax.lax.cond(jnp.any(settings.temperature > 0), sample, lambda _: greedy, None)
    return jnp.where(settings.temperature == 0, greedy, sampled).astype(jnp.int32)


def _draw(key: PRNGKeyArray, logits: Float[Array, " vocab"]) -> Int[Array, ""]:
    """A token drawn with probability softmax(logits), by inverting the cumulative distribution
    at one uniform number. `jax.random.categorical` draws a Gumbel number per token instead: on
    CPU that took 60 ms for 64 rows of a 49k vocabulary, this 14 ms."""
    probs = jax.nn.softmax(logits)
    cdf = jnp.cumsum(probs)
    index = jnp.sum(cdf <= jax.random.uniform(key) * cdf[-1])  # the first with cdf above it
    return jnp.where(index < logits.shape[-1], index, jnp.argmax(probs))  # (float rounding)
