"""Speculative decoding on the engine: guess K tokens cheaply, verify them in one target forward.

Each round, every decoding slot gets up to K guesses of its next tokens from one of two sources:

- **prompt lookup** (n-gram; Saxena 2023, transformers' `prompt_lookup_num_tokens`): the last
  n tokens of the sequence (prompt + output; n = 3, then 2, then 1) are looked for among its
  earlier tokens, and the K tokens that followed the latest match are the guesses. No second
  model; it pays off on text that repeats its context (code edits, quoting, summaries).
- **a draft model** sharing the target's vocabulary: it runs K + 1 decode steps over its own
  paged pools (the same page tables and blocks as the target's, so prefix reuse and
  preemption hold for both), sampling each guess from its own distribution q.

The target then feeds the pending token and the guesses, K + 1 positions, through its paged
cache in one call (a chunk, as a prefill writes) and accepts the longest prefix of guesses its
own distributions allow, by the rejection rule of Leviathan et al. (2023) and Chen et al.
(2023): guess g is kept with probability min(1, p(g) / q(g)); at the first rejection the next
token is drawn from norm(max(0, p - q)), and when every guess is kept one more is drawn from the
target after the last one. For prompt lookup q is a point mass on the guess. For greedy rows p
and q are point masses on their argmax, so greedy output equals non-speculative greedy output
token for token; sampled output follows the target's distribution (with its temperature,
filters and repetition penalty). Cache positions past the accepted ones hold rejected guesses:
they lie at or beyond the slot's new position, so no step reads them before it writes them
again.

With LoRA adapters (`eqllm.generation.adapters`) the target's call runs each row with its own
adapter, so p, and the output, are those of the row's adapted model: greedy output equals that
adapter's non-speculative output. Prompt lookup reads the row's own sequence. A draft model
holds no adapters: it guesses with its own weights for every row, so the guesses are as good as
the draft's agreement with the adapted model, and an adapter that moves the base's
distribution far lowers the acceptance (never the output's exactness or distribution).

K is static: every round compiles to the same shapes (slots and view buckets as a decode
step's), so nothing recompiles per request.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from eqllm.generation.paged import forward, forward_hidden
from eqllm.generation.sampling import Sampling, filter_logits, penalize_repetition
from eqllm.generation.steps import NO_TOKEN, TRACES, Sampled, SlotState, _sample_rows

# Device side -------------------------------------------------------------------------------------


def distribution(
    logits: Float[Array, "rows vocab"], present: Bool[Array, "rows vocab"], settings: Sampling
) -> Float[Array, "rows vocab"]:
    """The distribution each row's next token is drawn from, as `sample_tokens` draws it: the
    repetition penalty, then a point mass on the argmax (temperature 0) or the softmax of the
    filtered logits."""
    penalty = jnp.broadcast_to(settings.repetition_penalty, logits.shape[:-1])[..., None]
    logits = penalize_repetition(logits, present, penalty)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])

    def sample(_):
        return jax.nn.softmax(filter_logits(logits, settings), axis=-1)

    probs = jax.lax.cond(jnp.any(settings.temperature > 0), sample, lambda _: greedy, None)
    return jnp.where((settings.temperature == 0)[..., None], greedy, probs)


def draw(key: Key[Array, ""], probs: Float[Array, " vocab"]) -> Int[Array, ""]:
    """A token drawn with probability `probs` (not necessarily normalised), by inverting the
    cumulative distribution at one uniform number."""
    cdf = jnp.cumsum(probs)
    index = jnp.sum(cdf <= jax.random.uniform(key) * cdf[-1])
    return jnp.where(index < probs.shape[-1], index, jnp.argmax(probs)).astype(jnp.int32)


def accept(
    p: Float[Array, "width vocab"],
    q: Float[Array, "k vocab"],
    guesses: Int[Array, " k"],
    count: Int[Array, ""],
    key: Key[Array, ""],
) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """Speculative sampling's acceptance for one row: (guesses kept, the token after them).

    `p[j]` is the target's distribution after the first j guesses, `q[j]` the distribution
    guess j + 1 was drawn from; only the first `count` guesses count. Guess j + 1 is kept with
    probability min(1, p[j](g) / q[j](g)); the token after the a kept ones is drawn from
    norm(max(0, p[a] - q[a])) after a rejection, from p[count] when all were kept.
    """
    k = guesses.shape[0]
    p_g = jnp.take_along_axis(p[:k], guesses[:, None], axis=1)[:, 0]
    q_g = jnp.take_along_axis(q, guesses[:, None], axis=1)[:, 0]
    u = jax.random.uniform(jax.random.fold_in(key, 0), (k,))
    kept = (u * q_g < p_g) & (jnp.arange(k) < count)  # u < p / q, without dividing by q
    a = jnp.sum(jnp.cumprod(kept))
    q_a = jnp.where(a < count, jnp.concatenate([q, jnp.zeros_like(q[:1])])[a], 0.0)
    residual = jnp.maximum(p[a] - q_a, 0.0)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p[a])  # p == q: rejection has prob 0
    return a, draw(jax.random.fold_in(key, 1), residual)


def propose(
    fixed,
    draft: SlotState,
    state: SlotState,
    pages: Int[Array, "slots pages"],
    active: Bool[Array, " slots"],
    count: Int[Array, " slots"],
    settings: Sampling,
    *,
    slots: int,
    width: int,
    block_size: int,
) -> tuple[SlotState, Int[Array, "slots k"], Float[Array, "slots k vocab"]]:
    """The draft's guesses for the first `slots` slots: `width` = K + 1 steps, step i feeding
    the pending token (i = 0) or guess i at the slot's position + i into the draft's pools and
    drawing guess i + 1 from the draft's distribution q (the last step only writes the cache,
    so that the draft holds every position the target may accept). A slot feeds `count` + 1
    positions; an inactive one none. Returns the draft state, the guesses and their q."""
    vocab = state.present.shape[1]
    position = state.position[:slots]
    keys = jax.vmap(jax.random.fold_in)(state.keys[:slots], state.step[:slots])
    row = jnp.arange(slots)

    def one(carry, i):
        cache, token, present = carry
        live = active & (i <= count)
        fed = jnp.where(live, position + i, -1)[:, None]
        logits, cache = forward(fixed, cache, pages, token[:, None], fed, position + i, block_size)
        q = distribution(logits, present, settings)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 2 + i)
        guess = jax.vmap(draw)(step_keys, q)
        present = present.at[row, jnp.where(live, guess, vocab)].set(True, mode="drop")
        return (cache, guess, present), (guess, q)

    carry = (draft.cache, state.token[:slots], state.present[:slots])
    (cache, _, _), (guesses, q) = jax.lax.scan(one, carry, jnp.arange(width))
    draft = eqx.tree_at(lambda s: s.cache, draft, cache)
    return draft, guesses[:-1].T, jnp.swapaxes(q[:-1], 0, 1)


def verify(
    fixed,
    state: SlotState,
    pages: Int[Array, "slots pages"],
    active: Bool[Array, " slots"],
    guesses: Int[Array, "slots k"],
    count: Int[Array, " slots"],
    q: Float[Array, "slots k vocab"] | None,
    settings: Sampling,
    top: Bool[Array, ""],
    adapter: Int[Array, " slots"] | None = None,
    *,
    slots: int,
    block_size: int,
) -> tuple[SlotState, Sampled]:
    """Feed each active slot's pending token and its first `count` guesses (left-padded to
    K + 1 positions) through the target's pools in one call, keep the guesses `accept` allows
    and draw the token after them. `q` None: the guesses are point masses (prompt lookup).
    `adapter` is each slot's LoRA adapter (`eqllm.generation.adapters`; None: a model without
    adapters), so that p is the distribution of the slot's own adapted model.

    Returns the state (each slot's pending token is the drawn one, its position moved past the
    kept guesses) and per slot K + 1 outputs: the kept guesses, the drawn token, then NO_TOKEN.
    """
    model = fixed[0]
    vocab, k = state.present.shape[1], guesses.shape[1]
    width = k + 1
    token, position = state.token[:slots], state.position[:slots]
    present, step = state.present[:slots], state.step[:slots]
    count = jnp.where(active, count, 0)
    n = jnp.where(active, count + 1, 0)
    fed = jnp.concatenate([token[:, None], guesses], axis=1)  # in order: fed[j] at position + j
    source = jnp.arange(width)[None] - (width - n)[:, None]  # left padding: negative
    tokens = jnp.take_along_axis(fed, jnp.clip(source, 0, width - 1), axis=1)
    positions = jnp.where(source >= 0, position[:, None] + source, -1)
    hidden, cache = forward_hidden(
        fixed, state.cache, pages, tokens, positions, position, block_size, adapter
    )
    back = jnp.clip(jnp.arange(width)[None] + (width - n)[:, None], 0, width - 1)
    hidden = jnp.take_along_axis(hidden, back[:, :, None], axis=1)  # in order again
    rows = hidden.reshape(slots * width, -1)  # one 2-D product with the head
    logits = model.logits(model.final_norm(rows)).reshape(slots, width, -1)
    # The target's present set after the first j guesses, for j = 0 .. K.
    guessed = jnp.cumsum(jax.nn.one_hot(guesses, vocab, dtype=jnp.int32), axis=1) > 0
    seen = present[:, None] | jnp.concatenate([jnp.zeros_like(guessed[:, :1]), guessed], axis=1)
    p = jax.vmap(distribution, in_axes=(1, 1, None), out_axes=1)(logits, seen, settings)
    if q is None:
        q = jax.nn.one_hot(guesses, vocab)
    keys = jax.vmap(jax.random.fold_in)(state.keys[:slots], step)
    kept, final = jax.vmap(accept)(p, q, guesses, count, keys)
    j = jnp.arange(width)[None]
    out = jnp.where(j < kept[:, None], jnp.concatenate([guesses, guesses[:, :1]], axis=1), NO_TOKEN)
    out = jnp.where(j == kept[:, None], final[:, None], out)
    out = jnp.where(active[:, None], out, NO_TOKEN)
    sampled = jax.vmap(_sample_rows, in_axes=(1, 1, None), out_axes=1)(
        logits, jnp.maximum(out, 0), top
    )
    sampled = eqx.tree_at(lambda s: s.token, sampled, out)
    emitted = jnp.where(active, kept + 1, 0)
    kept_seen = jnp.take_along_axis(seen, kept[:, None, None], axis=1)[:, 0]
    present = jnp.where(active[:, None], kept_seen, present)
    present = present.at[jnp.arange(slots), jnp.where(active, final, vocab)].set(True, mode="drop")
    state = SlotState(
        cache=cache,
        token=state.token.at[:slots].set(jnp.where(active, final, token)),
        position=state.position.at[:slots].set(position + emitted),
        present=state.present.at[:slots].set(present),
        keys=state.keys,
        step=state.step.at[:slots].set(step + emitted),
    )
    return state, sampled


# Compiled steps ----------------------------------------------------------------------------------

_JITTED: dict = {}


def jitted(name: str, fn, static, donate: tuple[int, ...], static_names: tuple[str, ...]):
    """`fn` jitted on (weights' arrays, *args), its weights' structure `static` bound; shared
    by every engine over weights of that structure; each trace counted in TRACES."""
    cache_key = (name, static)
    if cache_key not in _JITTED:

        def run(params, *args, **sizes):
            TRACES[name] = TRACES.get(name, 0) + 1  # runs only while tracing
            return fn(eqx.combine(params, static), *args, **sizes)

        _JITTED[cache_key] = jax.jit(run, donate_argnums=donate, static_argnames=static_names)
    return _JITTED[cache_key]
