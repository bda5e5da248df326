"""The engine's device state and its compiled steps: a prefill chunk, decode steps, prompt scores.

Each step runs the model's forward over the paged pools (`eqllm.generation.paged`). Per-slot
arrays (the pending token, its position, the repetition-penalty set, the key and the sampling
step) have a leading `slots` axis. State that a layer kind keeps per sequence at a fixed size (a
hybrid's linear-attention layers: the recurrent state and the convolution's last inputs) sits
in the cache in place of that layer's pool, with a leading `slots` axis too
(`eqllm.generation.recurrent`).

The state is donated to every step, so it is updated in place. Shapes are fixed by the call's
static sizes (rows, chunk width, view length, decode steps), never by a request.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, Key

from eqllm.generation import recurrent
from eqllm.generation.adapters import with_index
from eqllm.generation.constrain import masked_logits
from eqllm.generation.paged import Pool, forward
from eqllm.generation.placement import place_weights, state_shardings
from eqllm.generation.sampling import Sampling, sample_tokens
from eqllm.model import CausalLM, dtype_of
from eqllm.trees import cast_floating

TOP_LOGPROBS = 5  # OpenAI's completions API allows at most 5 alternatives per token
NO_TOKEN = -1  # a row that did not sample at a decode step
SCORE_ROWS = 256  # prompt positions whose logits are computed at once when scoring a prompt


class SlotState(eqx.Module):
    """The device state: the paged pools, and every slot's arrays (leading `slots` axis).

    `token` is a slot's last sampled token, not yet fed to the model, at `position` (which is
    also how many positions of the slot are cached); `step` counts the tokens sampled for the
    slot's request (the key is folded with it, as in `eqllm.generate`); `present` marks tokens
    of its prompt and output (repetition penalty).
    """

    cache: tuple  # per layer: a Pool, a recurrent state per slot (recurrent.State), or both
    token: Int[Array, " slots"]
    position: Int[Array, " slots"]
    present: Bool[Array, "slots vocab"]
    keys: Key[Array, " slots"]
    step: Int[Array, " slots"]


class Sampled(eqx.Module):
    """A sampled token per row (and step) with its log-probability and, when asked for, the
    most likely alternatives (else zeros)."""

    token: Int[Array, "*rows"]
    logprob: Float[Array, "*rows"]
    top_tokens: Int[Array, "*rows k"]
    top_logprobs: Float[Array, "*rows k"]


def empty_state(model: CausalLM, slots: int, blocks: int, block_size: int) -> SlotState:
    """Every slot empty; pools of `blocks` blocks of `block_size` positions per layer."""
    rows = blocks * block_size
    return SlotState(
        cache=tuple(_empty(t, slots, rows) for t in model.init_cache(1)),
        token=jnp.zeros((slots,), jnp.int32),
        position=jnp.zeros((slots,), jnp.int32),
        present=jnp.zeros((slots, model.config.vocab_size), bool),
        keys=jax.random.split(jax.random.key(0), slots),
        step=jnp.zeros((slots,), jnp.int32),
    )


def _empty(template, slots: int, rows: int):
    """A layer's empty entry from one sequence's cache `template`: a pool, a state per slot, or
    the pair of both (a layer with a mixer beside attention)."""
    if isinstance(template, tuple):
        return tuple(_empty(t, slots, rows) for t in template)
    return (
        recurrent.for_slots(template, slots)
        if recurrent.is_state(template)
        else Pool.empty(template, rows)
    )


def _sampled(logits: Float[Array, " vocab"], token: Int[Array, ""], top: Array) -> Sampled:
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32))

    def alternatives(_):
        values, tokens = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        return tokens.astype(jnp.int32), values

    def none(_):
        return jnp.zeros(TOP_LOGPROBS, jnp.int32), jnp.zeros(TOP_LOGPROBS, jnp.float32)

    top_tokens, top_logprobs = jax.lax.cond(top, alternatives, none, None)
    return Sampled(token, logprobs[token], top_tokens, top_logprobs)


def _sample_rows(logits, token, top) -> Sampled:
    return jax.vmap(_sampled, in_axes=(0, 0, None))(logits, token, top)


def prefill_chunk(
    fixed,
    state: SlotState,
    slots: Int[Array, " rows"],
    pages: Int[Array, "rows pages"],
    tokens: Int[Array, "rows chunk"],
    positions: Int[Array, "rows chunk"],
    first: Bool[Array, " rows"],
    last: Bool[Array, " rows"],
    keys: Key[Array, " rows"],
    step: Int[Array, " rows"],
    seen: Bool[Array, "rows vocab"],
    settings: Sampling,
    top: Bool[Array, ""],
    allowed: Int[Array, "rows words"],
    adapter: Int[Array, " rows"] | None = None,
    *,
    block_size: int,
) -> tuple[SlotState, Sampled]:
    """Write one left-padded chunk of each row's sequence into its slot's blocks (a row whose
    slot is out of range is padding: nothing written); sample each `last` row's next token.

    A `first` chunk starts its slot afresh: its repetition set becomes `seen` (the tokens before
    the chunk that are cached already, a reused prefix) plus the chunk. The sample at the end of
    a `last` chunk is the sequence's step-th (`step`, 0 for a new prompt), so that a sequence
    computed again after it was preempted draws what it would have drawn. `allowed` is each
    row's bitmask of the tokens it may sample (`eqllm.generation.constrain`); `adapter` its
    LoRA adapter (`eqllm.generation.adapters`; None: a model without adapters).
    """
    vocab = state.present.shape[1]
    n = jnp.sum(positions >= 0, axis=1)
    start = jnp.max(positions, axis=1) + 1 - n
    cache = recurrent.gather(state.cache, slots, first)  # a first chunk starts from zeros
    logits, cache = forward(fixed, cache, pages, tokens, positions, start, block_size, adapter)
    cache = recurrent.scatter(state.cache, cache, slots)
    rows = jnp.arange(slots.shape[0])[:, None]
    kept = state.present.at[slots].get(mode="fill", fill_value=False)
    present = jnp.where(first[:, None], seen, kept | seen)
    present = present.at[rows, jnp.where(positions >= 0, tokens, vocab)].set(True, mode="drop")
    folded = jax.vmap(jax.random.fold_in)(keys, step)
    token = sample_tokens(masked_logits(logits, allowed), folded, present, settings)
    out = _sample_rows(logits, token, top)
    present = present.at[rows[:, 0], jnp.where(last, token, vocab)].set(True, mode="drop")

    def put(array, value):
        return array.at[slots].set(value, mode="drop")

    state = SlotState(
        cache=cache,
        token=put(state.token, jnp.where(last, token, 0)),
        position=put(state.position, start + n),
        present=put(state.present, present),
        keys=put(state.keys, keys),
        step=put(state.step, step + 1),
    )
    return state, out


def decode_steps(
    fixed,
    state: SlotState,
    pages: Int[Array, "slots pages"],
    active: Bool[Array, " slots"],
    remaining: Int[Array, " slots"],
    stop: Int[Array, "slots n_stop"],
    settings: Sampling,
    top: Bool[Array, ""],
    allowed: Int[Array, "slots words"],
    adapter: Int[Array, " slots"] | None = None,
    *,
    slots: int,
    steps: int,
    block_size: int,
) -> tuple[SlotState, Sampled]:
    """Up to `steps` tokens for each active slot among the first `slots`, all on device.

    Each step feeds a slot its pending token and samples the next; a slot stops once it has
    sampled `remaining` tokens or one of its `stop` ids (-1: none), and the loop ends early when
    every slot stopped. Each step runs `forward` over the pools, which the loop carries (the
    pages must cover position + steps). Outputs of a slot that did not sample at a step are
    NO_TOKEN. Other slots are untouched. `allowed` (each slot's bitmask of the tokens it may
    sample) holds at every step: a constrained slot runs one step per call. `adapter` is each
    slot's LoRA adapter.
    """
    vocab = state.present.shape[1]
    keys = state.keys[:slots]
    row = jnp.arange(slots)

    def running(carry):
        i, live, *_ = carry
        return (i < steps) & jnp.any(live)

    def one(carry):
        i, live, cache, token, position, step, present, remaining, out = carry
        fed = jnp.where(live, position, -1)[:, None]  # a stopped slot writes nothing
        logits, cache = forward(
            fixed, cache, pages, token[:, None], fed, position, block_size, adapter
        )
        folded = jax.vmap(jax.random.fold_in)(keys, step)
        new = sample_tokens(masked_logits(logits, allowed), folded, present, settings)
        sampled = _sample_rows(logits, new, top)
        sampled = eqx.tree_at(lambda s: s.token, sampled, jnp.where(live, new, NO_TOKEN))
        out = jax.tree.map(lambda o, s: o.at[:, i].set(s), out, sampled)
        present = present.at[row, jnp.where(live, new, vocab)].set(True, mode="drop")
        remaining = remaining - live
        stopped = jnp.any(new[:, None] == stop, axis=1) | (remaining <= 0)
        return (
            i + 1,
            live & ~stopped,
            cache,
            jnp.where(live, new, token),
            position + live,
            step + live,
            present,
            remaining,
            out,
        )

    out = Sampled(
        jnp.full((slots, steps), NO_TOKEN, jnp.int32),
        jnp.zeros((slots, steps), jnp.float32),
        jnp.zeros((slots, steps, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((slots, steps, TOP_LOGPROBS), jnp.float32),
    )
    live = active & (remaining > 0)
    carry = (
        0,
        live,
        recurrent.first_slots(state.cache, slots),
        state.token[:slots],
        state.position[:slots],
        state.step[:slots],
        state.present[:slots],
        remaining,
        out,
    )
    _, _, cache, token, position, step, present, _, out = jax.lax.while_loop(running, one, carry)
    state = SlotState(
        cache=recurrent.put_first(state.cache, cache, slots),
        token=state.token.at[:slots].set(token),
        position=state.position.at[:slots].set(position),
        present=state.present.at[:slots].set(present),
        keys=state.keys,
        step=state.step.at[:slots].set(step),
    )
    return state, out


def prompt_logprobs(
    fixed, tokens: Int[Array, " width"], adapter: Int[Array, ""] | None = None
) -> Sampled:
    """Per position i of a right-padded prompt: the log-probability of token i + 1 after the
    first i + 1 tokens, and the most likely alternatives there (the full forward, in fp32).

    The padding follows the prompt, so attention (causal) keeps it out of the prompt's rows,
    which are computed in order: attention skips the key blocks the mask zeroes. The head runs
    over SCORE_ROWS positions at a time, not the whole width at once: fp32 logits of 8,192
    positions of a 49,152-word vocabulary are 1.6 GB, and their log-softmax as much again.
    """
    model, layers = fixed
    if adapter is not None:  # the prompt's LoRA adapter (eqllm.generation.adapters)
        layers = with_index(layers, adapter)
    model = model.with_layers(layers)  # the stacks, for this call only
    hidden = model.hidden(tokens)
    targets = jnp.concatenate([tokens[1:], tokens[:1]])  # the last row is not used

    def row(args):
        h, target = args
        return _sampled(model.logits(h).astype(jnp.float32), target, jnp.asarray(True))

    return jax.lax.map(row, (hidden, targets), batch_size=SCORE_ROWS)


@eqx.filter_jit
def _sliced(model: CausalLM) -> tuple[CausalLM, tuple]:
    """The model in its compute dtype without its stacks, and its layers sliced apart (one
    compiled call rather than an eager slice per array)."""
    model = cast_floating(model, dtype_of(model.config.compute_dtype))
    return model.without_stacks(), model.layers()


TRACES: dict[str, int] = {}  # how often each step was traced, in this process
_COMPILED: dict = {}


def compiled(model: CausalLM, mesh: Mesh | None = None):
    """The three steps, and the weights they run on: (model without its blocks, layers).

    The weights are cast to the compute dtype and sliced into layers once; only the sliced
    layers are kept. They are arguments of the steps (never compile-time constants); the state
    is donated. The jitted steps are shared by every engine over a model of the same structure
    (so `eqllm.generate`, which makes an engine per call, compiles each shape once). Each trace
    is counted in TRACES, so a test can check that nothing recompiles.

    On a `mesh` the weights are placed by the sharding rules and every step returns the state
    split as `state_shardings` says, the placement it was given, so nothing recompiles.
    """
    if mesh is None:
        weights = _sliced(model)
    else:
        model = cast_floating(model, dtype_of(model.config.compute_dtype))
        weights = place_weights(model, model.layers(), mesh)
    params, static = eqx.partition(weights, eqx.is_array)
    cache_key = (static, mesh)
    if cache_key not in _COMPILED:
        _COMPILED[cache_key] = _jitted(static, mesh)
    jitted = _COMPILED[cache_key]
    return {name: _bound(fn, params) for name, fn in jitted.items()}, weights


def _bound(fn, params):
    return lambda *args, **sizes: fn(params, *args, **sizes)


def _jitted(static, mesh: Mesh | None) -> dict:
    def wrap(name, fn, donate, static_names=()):
        def run(params, *args, **sizes):
            TRACES[name] = TRACES.get(name, 0) + 1  # runs only while tracing
            out = fn(eqx.combine(params, static), *args, **sizes)
            if mesh is not None and donate:  # (state, sampled): keep the state's placement
                state, sampled = out
                out = jax.lax.with_sharding_constraint(state, state_shardings(state, mesh)), sampled
            return out

        return jax.jit(run, donate_argnums=donate, static_argnames=static_names)

    return {
        "prefill": wrap("prefill", prefill_chunk, (1,), ("block_size",)),
        "decode": wrap("decode", decode_steps, (1,), ("slots", "steps", "block_size")),
        "score": wrap("score", prompt_logprobs, ()),
    }
