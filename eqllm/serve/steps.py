"""The engine's compiled steps over a fixed batch of slots: a prefill chunk, a decode step, and
the log-probabilities of a prompt (for `echo`).

The slots' KV caches and per-slot decode state are one `SlotState`, allocated once and donated
to every step, so it is updated in place. A step only ever sees fixed shapes: the slot count,
the cache length, and a prompt chunk or scored prompt padded to a bucket. The model's own
`prefill` / `decode` do the forward and `eqllm.generation.sample_tokens` the sampling, so a
request samples exactly as `eqllm.generate` does with the same key.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, Key

from eqllm.generation import Sampling, sample_tokens
from eqllm.model import CausalLM, cast_floating, dtype_of
from eqllm.nn import KVCache, LatentCache
from eqllm.serve.placement import place_weights, state_shardings

TOP_LOGPROBS = 5  # OpenAI's completions API allows at most 5 alternatives per token


class SlotState(eqx.Module):
    """The device state of every slot, each array with a leading `slots` axis.

    `token` is a slot's last sampled token, not yet fed to the model, at `position`; `step`
    counts the tokens sampled for the slot's request (the key is folded with it, as in
    `eqllm.generate`); `present` marks tokens of its prompt and output (repetition penalty).
    """

    cache: tuple[KVCache | LatentCache, ...]
    token: Int[Array, " slots"]
    position: Int[Array, " slots"]
    present: Bool[Array, "slots vocab"]
    keys: Key[Array, " slots"]
    step: Int[Array, " slots"]


class Sampled(eqx.Module):
    """A sampled token per row with its log-probability and the most likely alternatives."""

    token: Int[Array, "*rows"]
    logprob: Float[Array, "*rows"]
    top_tokens: Int[Array, "*rows k"]
    top_logprobs: Float[Array, "*rows k"]


def empty_state(model: CausalLM, slots: int, length: int) -> SlotState:
    """Every slot empty; `length` positions of KV cache per slot."""
    cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (slots, *a.shape)), model.init_cache(length))
    return SlotState(
        cache=jax.tree.map(jnp.array, cache),  # broadcasts materialised: donated buffers
        token=jnp.zeros((slots,), jnp.int32),
        position=jnp.zeros((slots,), jnp.int32),
        present=jnp.zeros((slots, model.config.vocab_size), bool),
        keys=jax.random.split(jax.random.key(0), slots),
        step=jnp.zeros((slots,), jnp.int32),
    )


def _sampled(logits: Float[Array, " vocab"], token: Int[Array, ""]) -> Sampled:
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32))
    top_logprobs, top_tokens = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    return Sampled(token, logprobs[token], top_tokens.astype(jnp.int32), top_logprobs)


def prefill_chunk(
    fixed,
    state: SlotState,
    slots: Int[Array, " rows"],
    tokens: Int[Array, "rows chunk"],
    positions: Int[Array, "rows chunk"],
    first: Bool[Array, " rows"],
    last: Bool[Array, " rows"],
    keys: Key[Array, " rows"],
    settings: Sampling,
) -> tuple[SlotState, Sampled]:
    """Write one left-padded chunk of a prompt into each row's slot (emptied first when `first`);
    after a prompt's `last` chunk, sample its first token with its key and arm the slot. A row
    whose slot is out of range (max_batch) is padding: nothing of it is written."""
    model, layers = fixed
    vocab = model.config.vocab_size
    emptied = tuple(
        eqx.tree_at(
            lambda c: c.positions,
            c,
            c.positions.at[slots].set(
                jnp.where(first[:, None], -1, c.positions[slots]), mode="drop"
            ),
        )
        for c in state.cache
    )
    cache = jax.tree.map(lambda a: a[slots], emptied)
    logits, cache = jax.vmap(lambda t, p, c: model.prefill(t, p, c, layers=layers))(
        tokens, positions, cache
    )
    rows = jnp.arange(slots.shape[0])[:, None]
    present = jnp.where(first[:, None], False, state.present[slots])
    present = present.at[rows, jnp.where(positions >= 0, tokens, vocab)].set(True, mode="drop")
    token = sample_tokens(logits, jax.vmap(jax.random.fold_in)(keys, 0 * slots), present, settings)
    out = jax.vmap(_sampled)(logits, token)
    present = present.at[rows[:, 0], jnp.where(last, token, vocab)].set(True, mode="drop")

    def put(array, value):
        return array.at[slots].set(value, mode="drop")

    state = SlotState(
        cache=_write_rows(emptied, cache, slots, positions, token),
        token=put(state.token, jnp.where(last, token, 0)),
        position=put(state.position, jnp.max(positions, axis=1) + 1),
        present=put(state.present, present),
        keys=put(state.keys, keys),
        step=put(state.step, jnp.ones_like(slots)),
    )
    return state, out


def _write_rows(
    cache,
    written,
    slots: Int[Array, " rows"],
    positions: Int[Array, "rows chunk"],
    sampled: Int[Array, "*tokens"],
):
    """`cache` (leaves: every slot x cache positions x ...) with the rows a step wrote into
    `written` (leaves: one entry per row of `slots`, maybe fewer positions) copied in: those of
    `positions` (negative: none), where a cache of any length keeps position p (p mod length).

    The write is made to depend on the step's `sampled` tokens (through a zero: tokens are >= 0),
    hence on every read of the cache. Without that dependency XLA's CPU scheduler could not
    order the reads before the in-place write and copied the whole slot state twice per step:
    a 16-token prefill chunk took 62 ms with 1 slot and 152 ms with 64 (smollm-135m).
    """
    rows = jnp.arange(slots.shape[0])[:, None]
    slots = slots + jnp.minimum(jnp.min(sampled), 0)

    def leaf(full, part):
        dropped = full.shape[1]  # out of range: not written
        where = jnp.where(positions >= 0, positions % full.shape[1], dropped)
        return full.at[slots[:, None], where].set(
            part[rows, positions % part.shape[1]], mode="drop"
        )

    return jax.tree.map(leaf, cache, written)


def decode_step(
    fixed,
    state: SlotState,
    active: Bool[Array, " slots"],
    settings: Sampling,
    *,
    slots: int,
    length: int,
) -> tuple[SlotState, Sampled]:
    """Feed every active slot among the first `slots` its last token and sample the next; other
    slots are untouched (their position is -1 for this step, so nothing is written to their
    cache). Attention reads the first `length` cache positions only: every active slot's
    positions lie below it (a ring cache shorter than `length` is read whole)."""
    model, layers = fixed
    vocab = state.present.shape[1]
    part = jax.tree.map(lambda a: a[:slots], state)
    cache = jax.tree.map(lambda a: a[:, :length], part.cache)
    position = jnp.where(active, part.position, -1)
    logits, cache = jax.vmap(lambda t, p, c: model.decode(t, p, c, layers=layers))(
        part.token, position, cache
    )
    keys = jax.vmap(jax.random.fold_in)(part.keys, part.step)
    token = sample_tokens(logits, keys, part.present, settings)
    out = jax.vmap(_sampled)(logits, token)
    present = part.present.at[jnp.arange(slots), jnp.where(active, token, vocab)].set(
        True, mode="drop"
    )
    state = eqx.tree_at(
        lambda s: (s.cache, s.token, s.position, s.present, s.step),
        state,
        (
            _write_rows(state.cache, cache, jnp.arange(slots), position[:, None], token),
            state.token.at[:slots].set(jnp.where(active, token, part.token)),
            state.position.at[:slots].add(active),
            state.present.at[:slots].set(present),
            state.step.at[:slots].add(active),
        ),
    )
    return state, out


def prompt_logprobs(
    fixed, tokens: Int[Array, " width"], positions: Int[Array, " width"]
) -> Sampled:
    """Per position i of a right-padded prompt: the log-probability of token i + 1 after the
    first i + 1 tokens, and the most likely alternatives there (the full forward, in fp32)."""
    model, layers = fixed
    model = model.with_layers(layers)  # the stacks, for this call only
    logits = model(tokens, positions).astype(jnp.float32)
    targets = jnp.concatenate([tokens[1:], tokens[:1]])  # the last row is not used
    return jax.vmap(_sampled)(logits, targets)


def compiled(model: CausalLM, traces: dict[str, int], mesh: Mesh | None = None):
    """The three steps, and the weights they run on: (model without its blocks, layers).

    The steps are compiled over the model cast to its compute dtype and sliced into layers
    once. The weights are arguments (never compile-time constants); the slot state is donated.
    `traces` counts how often each step is traced, so a test can check nothing recompiles.

    Only the sliced layers are kept (the stacked blocks are dropped: one copy of the weights).
    On a `mesh` the weights are placed by the sharding rules and every step returns the slot
    state split as `state_shardings` says, the placement it was given, so nothing recompiles.
    """
    model = cast_floating(model, dtype_of(model.config.compute_dtype))
    layers = model.layers()
    if mesh is None:
        model = model.without_stacks()
    else:
        model, layers = place_weights(model, layers, mesh)
    params, static = eqx.partition((model, layers), eqx.is_array)

    def wrap(name, fn, donate, static_names=()):
        def run(params, *args, **sizes):
            traces[name] = traces.get(name, 0) + 1  # runs only while tracing
            out = fn(eqx.combine(params, static), *args, **sizes)
            if mesh is not None and donate:  # (state, sampled): keep the state's placement
                state, sampled = out
                out = jax.lax.with_sharding_constraint(state, state_shardings(state, mesh)), sampled
            return out

        jitted = jax.jit(run, donate_argnums=donate, static_argnames=static_names)
        return lambda *args, **sizes: jitted(params, *args, **sizes)

    steps = {
        "prefill": wrap("prefill", prefill_chunk, (1,)),
        "decode": wrap("decode", decode_step, (1,), ("slots", "length")),
        "score": wrap("score", prompt_logprobs, ()),
    }
    return steps, (model, layers)
