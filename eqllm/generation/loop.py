"""The compiled generation loop: prefill a batch of prompts, then decode on device.

Every array has a leading batch axis; the model's `prefill` / `decode` act on one sequence and
are vmapped. The layers are sliced out of the stacked blocks once (`CausalLM.layers`), outside
the loop. The decode loop is a `lax.while_loop` that stops at the token limit or once every
row has produced a stop token. Rows that stopped emit NO_TOKEN.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from eqllm.generation.sampling import Sampling, sample_tokens
from eqllm.model import CausalLM, cast_floating, dtype_of
from eqllm.nn import Block, KVCache, LatentCache

NO_TOKEN = -1  # fills the output after a row has stopped


class DecodeState(eqx.Module):
    """Everything the decode loop carries from one token to the next, for a batch of rows.

    `token` is the last sampled token, not yet fed to the model, at position `position`.
    `count` is the number of tokens a row has produced (its stop token included); `done` marks
    rows that produced a stop token. `step` counts sampling steps, `limit` is max_new_tokens.
    """

    cache: tuple[KVCache | LatentCache, ...]  # one per layer, each with a leading batch axis
    token: Int[Array, " batch"]
    position: Int[Array, " batch"]
    present: Bool[Array, "batch vocab"]
    keys: Key[Array, " batch"]
    count: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    step: Int[Array, ""]
    limit: Int[Array, ""]


def _sample_into(
    state: DecodeState,
    logits: Float[Array, "batch vocab"],
    settings: Sampling,
    stop: Int[Array, " n_stop"],
) -> tuple[DecodeState, Int[Array, " batch"]]:
    """Sample every row's next token into the state; rows already done emit NO_TOKEN."""
    batch = logits.shape[0]
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys, state.step)
    token = sample_tokens(logits, keys, state.present, settings)
    live = ~state.done
    stopped = live & jnp.any(token[:, None] == stop[None, :], axis=-1)
    emitted = jnp.where(live, token, NO_TOKEN)
    state = eqx.tree_at(
        lambda s: (s.token, s.present, s.count, s.done, s.step),
        state,
        (
            jnp.where(live, token, 0),  # a stopped row keeps decoding a harmless token 0
            state.present.at[jnp.arange(batch), token].set(True),
            state.count + live,
            state.done | stopped,
            state.step + 1,
        ),
    )
    return state, emitted


def prefill(
    model: CausalLM,
    layers: tuple[Block, ...],
    tokens: Int[Array, "batch prompt"],
    positions: Int[Array, "batch prompt"],
    keys: Key[Array, " batch"],
    settings: Sampling,
    stop: Int[Array, " n_stop"],
    limit: Int[Array, ""],
    *,
    length: int,
) -> tuple[DecodeState, Int[Array, " batch"]]:
    """Run the left-padded prompts into a fresh cache for `length` positions; sample token one."""
    batch, _ = tokens.shape
    vocab = model.config.vocab_size
    empty = jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)), model.init_cache(length))
    logits, cache = jax.vmap(lambda t, p, c: model.prefill(t, p, c, layers=layers))(
        tokens, positions, empty
    )
    present_index = jnp.where(positions >= 0, tokens, vocab)  # padding: out of range, dropped
    present = (
        jnp.zeros((batch, vocab), bool)
        .at[jnp.arange(batch)[:, None], present_index]
        .set(True, mode="drop")
    )
    state = DecodeState(
        cache=cache,
        token=jnp.zeros((batch,), jnp.int32),
        position=jnp.max(positions, axis=1) + 1,
        present=present,
        keys=keys,
        count=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        step=jnp.asarray(0, jnp.int32),
        limit=jnp.asarray(limit, jnp.int32),
    )
    return _sample_into(state, logits, settings, stop)


def decode(
    model: CausalLM,
    layers: tuple[Block, ...],
    state: DecodeState,
    settings: Sampling,
    stop: Int[Array, " n_stop"],
    *,
    steps: int,
) -> tuple[DecodeState, Int[Array, "batch steps"]]:
    """Up to `steps` more tokens per row, stopping early once the limit or every row's stop
    token is reached. Missing outputs are NO_TOKEN."""
    batch = state.token.shape[0]

    def running(carry):
        i, state, _ = carry
        return (i < steps) & (state.step < state.limit) & ~jnp.all(state.done)

    def one_token(carry):
        i, state, out = carry
        logits, cache = jax.vmap(lambda t, p, c: model.decode(t, p, c, layers=layers))(
            state.token, state.position, state.cache
        )
        state = eqx.tree_at(lambda s: (s.cache, s.position), state, (cache, state.position + 1))
        state, token = _sample_into(state, logits, settings, stop)
        return i + 1, state, out.at[:, i].set(token)

    out = jnp.full((batch, steps), NO_TOKEN, jnp.int32)
    _, state, out = jax.lax.while_loop(running, one_token, (jnp.asarray(0), state, out))
    return state, out


@eqx.filter_jit
def generate_compiled(
    model: CausalLM,
    tokens: Int[Array, "batch prompt"],
    positions: Int[Array, "batch prompt"],
    keys: Key[Array, " batch"],
    settings: Sampling,
    stop: Int[Array, " n_stop"],
    *,
    max_new_tokens: int,
) -> tuple[Int[Array, "batch new"], Int[Array, " batch"]]:
    """Prefill and decode in one compiled call: the new tokens and each row's count."""
    model = cast_floating(model, dtype_of(model.config.compute_dtype))  # once, not per token
    layers = model.layers()  # once, outside the decode loop
    limit = jnp.asarray(max_new_tokens, jnp.int32)
    length = tokens.shape[1] + max_new_tokens
    state, first = prefill(
        model, layers, tokens, positions, keys, settings, stop, limit, length=length
    )
    if max_new_tokens == 1:
        return first[:, None], state.count
    state, rest = decode(model, layers, state, settings, stop, steps=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1), state.count


prefill_compiled = eqx.filter_jit(prefill)


@eqx.filter_jit(donate="all-except-first")
def decode_chunk(
    fixed: tuple[CausalLM, tuple[Block, ...], Sampling, Int[Array, " n_stop"]],
    state: DecodeState,
    *,
    steps: int,
) -> tuple[DecodeState, Int[Array, "batch steps"]]:
    """`decode` with the state donated: the cache is updated in place from chunk to chunk."""
    model, layers, settings, stop = fixed
    return decode(model, layers, state, settings, stop, steps=steps)
