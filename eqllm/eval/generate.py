"""Text generation: KV-cache prefill, a decode loop compiled to run on device, and sampling.

One generation is two compiled pieces joined in one `eqx.filter_jit`:

- **prefill**: one forward pass over the (left-padded) prompts writes every layer's keys and
  values into a `KVCache` with a static number of slots and samples the first new token;
- **decode**: a `lax.while_loop` feeds the last sampled token back one position at a time,
  entirely on device, until `max_new_tokens` or until every row has produced a stop token.

Prompts are padded on the left to a power-of-two bucket, so a batch of different lengths shares
one compilation and the last column holds every row's next-token logits. Padding has negative
positions: the cache drops it and `attention_mask` hides it. Sampling settings are arrays, so
changing temperature or top-p does not recompile.

Streaming (`stream`) runs the same decode loop in chunks of a few tokens, carrying the
(donated) state between calls: Python prints between chunks and every token is still produced
by compiled code. A chunk of 8-16 tokens costs one dispatch per chunk, which is why it was
chosen over a `jax.debug.callback` per token (a host round trip inside every step).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqllm.model import CausalLM, cast_floating, dtype_of
from eqllm.nn import Block, KVCache

NO_TOKEN = -1  # fills the output after a row has stopped
MIN_BUCKET = 16


# --------------------------------------------------------------------------------------------
# The cached forward pass


def cache_slots(model: CausalLM, wanted: int) -> int:
    """Slots a cache needs to serve `wanted` positions: at most the context, at most the window."""
    cfg = model.config
    slots = min(wanted, cfg.max_seq_len)
    if cfg.sliding_window is not None:
        slots = min(slots, cfg.sliding_window)
    return slots


def init_cache(model: CausalLM, slots: int) -> KVCache:
    """An empty cache for one sequence: arrays `(layers, slots, kv_heads, head_dim)`.

    Only the kv heads are cached (grouped-query attention shares them), in the compute dtype.
    """
    cfg = model.config
    one = KVCache.empty(slots, cfg.n_kv_heads, cfg.head_dim, dtype_of(cfg.compute_dtype))
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.n_layers, *a.shape)), one)


def forward_cached(
    model: CausalLM,
    tokens: Int[Array, " seq"],
    positions: Int[Array, " seq"],
    cache: KVCache,
) -> tuple[Float[Array, "seq d_model"], KVCache]:
    """Final-norm hidden states of new positions attending to the cache; the updated cache.

    The same blocks as `model(tokens)`, scanned over layers together with the cache's layer
    axis. `model.logits(hidden)` turns the result into logits.
    """
    cfg = model.config
    model = cast_floating(model, dtype_of(cfg.compute_dtype))  # no-op when already cast
    x = model.embed_inputs(tokens, positions)
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def layer(h, layer_params_and_cache):
        layer_params, layer_cache = layer_params_and_cache
        block = eqx.combine(layer_params, static)
        return block.cached(h, positions, layer_cache)

    x, cache = jax.lax.scan(layer, x, (params, cache))
    return model.final_norm(x), cache


def unstack_layers(tree, n_layers: int) -> tuple:
    """The `n_layers` slices of a tree whose arrays have a leading layers axis."""
    params, static = eqx.partition(tree, eqx.is_array)
    return tuple(
        eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static) for i in range(n_layers)
    )


def _forward_layers(
    model: CausalLM,
    layers: tuple[Block, ...],
    tokens: Int[Array, " seq"],
    positions: Int[Array, " seq"],
    caches: tuple[KVCache, ...],
) -> tuple[Float[Array, "seq d_model"], tuple[KVCache, ...]]:
    """`forward_cached` over layers already sliced apart, one cache per layer.

    The decode loop uses this form: under `lax.scan`, XLA on CPU copies each layer's weights
    out of the stacked arrays at every step, which made decoding 3-4x slower than reading them
    in place (measured on gpt2-small). Compile time grows with depth here, not in training.
    """
    x = model.embed_inputs(tokens, positions)
    written = []
    for block, cache in zip(layers, caches, strict=True):
        x, cache = block.cached(x, positions, cache)
        written.append(cache)
    return model.final_norm(x), tuple(written)


# --------------------------------------------------------------------------------------------
# Sampling


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
    """Validated sampling settings (None switches a filter off)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (None: off), got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must lie in [0, 1] (None: off), got {min_p}")
    if repetition_penalty is not None and not (
        math.isfinite(repetition_penalty) and repetition_penalty > 0
    ):
        raise ValueError(
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


# --------------------------------------------------------------------------------------------
# Prefill and the decode loop (batched: every array has a leading batch axis)


class DecodeState(eqx.Module):
    """Everything the decode loop carries from one token to the next, for a batch of rows.

    `token` is the last sampled token, not yet fed to the model, at position `position`.
    `count` is the number of tokens a row has produced (its stop token included); `done` marks
    rows that produced a stop token. `step` counts sampling steps, `limit` is max_new_tokens.
    """

    cache: tuple[KVCache, ...]  # one per layer
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
    token = jax.vmap(sample_token, in_axes=(0, 0, 0, None))(logits, keys, state.present, settings)
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


def _prefill(
    model: CausalLM,
    layers: tuple[Block, ...],
    tokens: Int[Array, "batch prompt"],
    positions: Int[Array, "batch prompt"],
    keys: Key[Array, " batch"],
    settings: Sampling,
    stop: Int[Array, " n_stop"],
    limit: Int[Array, ""],
    *,
    slots: int,
) -> tuple[DecodeState, Int[Array, " batch"]]:
    """Run the left-padded prompts through the model into a fresh cache; sample token one."""
    batch, _ = tokens.shape
    vocab = model.config.vocab_size
    cfg = model.config
    empty = KVCache.empty(slots, cfg.n_kv_heads, cfg.head_dim, dtype_of(cfg.compute_dtype))
    empty = jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)), empty)
    hidden, cache = jax.vmap(_forward_layers, in_axes=(None, None, 0, 0, 0))(
        model, layers, tokens, positions, (empty,) * cfg.n_layers
    )
    logits = model.logits(hidden[:, -1])  # left padding: last column is real
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


def _decode(
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
        hidden, cache = jax.vmap(_forward_layers, in_axes=(None, None, 0, 0, 0))(
            model, layers, state.token[:, None], state.position[:, None], state.cache
        )
        logits = model.logits(hidden[:, 0])
        state = eqx.tree_at(lambda s: (s.cache, s.position), state, (cache, state.position + 1))
        state, token = _sample_into(state, logits, settings, stop)
        return i + 1, state, out.at[:, i].set(token)

    out = jnp.full((batch, steps), NO_TOKEN, jnp.int32)
    _, state, out = jax.lax.while_loop(running, one_token, (jnp.asarray(0), state, out))
    return state, out


@eqx.filter_jit
def _generate_compiled(
    model: CausalLM,
    tokens: Int[Array, "batch prompt"],
    positions: Int[Array, "batch prompt"],
    keys: Key[Array, " batch"],
    settings: Sampling,
    stop: Int[Array, " n_stop"],
    *,
    max_new_tokens: int,
    slots: int,
) -> tuple[Int[Array, "batch new"], Int[Array, " batch"]]:
    model = cast_floating(model, dtype_of(model.config.compute_dtype))  # once, not per token
    layers = unstack_layers(model.blocks, model.config.n_layers)  # once, outside the loop
    limit = jnp.asarray(max_new_tokens, jnp.int32)
    state, first = _prefill(
        model, layers, tokens, positions, keys, settings, stop, limit, slots=slots
    )
    if max_new_tokens == 1:
        return first[:, None], state.count
    state, rest = _decode(model, layers, state, settings, stop, steps=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1), state.count


_prefill_compiled = eqx.filter_jit(_prefill)


@eqx.filter_jit(donate="all-except-first")
def _decode_chunk(
    fixed: tuple[CausalLM, tuple[Block, ...], Sampling, Int[Array, " n_stop"]],
    state: DecodeState,
    *,
    steps: int,
) -> tuple[DecodeState, Int[Array, "batch steps"]]:
    model, layers, settings, stop = fixed
    return _decode(model, layers, state, settings, stop, steps=steps)


# --------------------------------------------------------------------------------------------
# Public API


def _as_prompt(prompt, row: int, vocab: int) -> np.ndarray:
    ids = np.asarray(prompt)
    if ids.ndim != 1:
        raise ValueError(
            f"prompt {row} must be a 1-D sequence of token ids, got shape {ids.shape}; "
            "for several prompts use generate_batch"
        )
    if ids.size == 0:
        raise ValueError(f"prompt {row} is empty; give at least one token to continue from")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"prompt {row} must hold integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"prompt {row} has token ids outside [0, vocab_size={vocab})")
    return ids.astype(np.int32)


def _typed_key(key) -> Array:
    key = jnp.asarray(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key from jax.random.PRNGKey
    return key


def _single_key(key) -> Key[Array, " 1"]:
    key = _typed_key(key)
    if key.shape != ():
        raise ValueError(f"key must be a single PRNG key, got an array of shape {key.shape}")
    return key[None]


def _row_keys(key, batch: int) -> Key[Array, " batch"]:
    key = _typed_key(key)
    if key.shape == ():
        return jax.random.split(key, batch)
    if key.shape == (batch,):
        return key
    raise ValueError(f"key must be one PRNG key or one per prompt ({batch}), got {key.shape}")


def bucket(length: int, max_seq_len: int) -> int:
    """The padded prompt length: the next power of two (at least 16), at most the context."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_seq_len)


def _prepare(model, prompts, max_new_tokens, stop_tokens):
    if not isinstance(model, CausalLM):
        raise TypeError(f"model must be an eqllm CausalLM, got {type(model).__name__}")
    cfg = model.config
    if len(prompts) == 0:
        raise ValueError("no prompts given; pass at least one prompt")
    rows = [_as_prompt(p, i, cfg.vocab_size) for i, p in enumerate(prompts)]
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens:
        raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    longest = max(len(r) for r in rows)
    if longest > cfg.max_seq_len:
        raise ValueError(
            f"a prompt of {longest} tokens is longer than the context "
            f"max_seq_len={cfg.max_seq_len}; shorten it"
        )
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the context max_seq_len={cfg.max_seq_len}; "
            f"lower max_new_tokens to at most {cfg.max_seq_len - longest} or shorten the prompt"
        )
    stop = np.asarray(list(stop_tokens), np.int32).reshape(-1)
    if stop.size and (stop.min() < 0 or stop.max() >= cfg.vocab_size):
        raise ValueError(f"stop_tokens must be token ids in [0, vocab_size={cfg.vocab_size})")
    # Padded with an id no token has, to a multiple of 8: a few more stops do not recompile.
    stop = np.pad(stop, (0, 8 * max(1, -(-len(stop) // 8)) - len(stop)), constant_values=-1)
    width = bucket(longest, cfg.max_seq_len)
    tokens = np.zeros((len(rows), width), np.int32)
    positions = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):  # left padding: every prompt ends in the last column
        tokens[i, width - len(r) :] = r
        positions[i, width - len(r) :] = np.arange(len(r))
    return tokens, positions, stop, width


def generate_batch(
    model: CausalLM,
    prompts: Sequence | np.ndarray | Array,
    *,
    max_new_tokens: int,
    key: Array,
    temperature: float | int = 1.0,
    top_k: int | None = None,
    top_p: float | int | None = None,
    min_p: float | int | None = None,
    repetition_penalty: float | int | None = None,
    stop_tokens: Sequence | np.ndarray = (),
) -> list[np.ndarray]:
    """Continue several prompts of any lengths at once; one compiled call.

    Arguments:
        model: the language model.
        prompts: token-id sequences, each non-empty.
        max_new_tokens: most tokens to generate per prompt; prompt + new must fit the context.
        key: one PRNG key (split into one per prompt) or an array of one key per prompt. Row i
            with key k_i gives what `generate(model, prompts[i], key=k_i)` gives.
        temperature: divides the logits; 0 is greedy decoding.
        top_k, top_p, min_p, repetition_penalty: see `filter_logits` and `penalize_repetition`.
        stop_tokens: a row ends after producing one of these (it is included in the output).

    Returns:
        One int32 array of new tokens per prompt.
    """
    settings = sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    tokens, positions, stop, width = _prepare(model, prompts, max_new_tokens, stop_tokens)
    keys = _row_keys(key, len(tokens))
    slots = cache_slots(model, width + max_new_tokens)
    out, counts = _generate_compiled(
        model, tokens, positions, keys, settings, stop, max_new_tokens=max_new_tokens, slots=slots
    )
    out, counts = np.asarray(out), np.asarray(counts)
    return [row[:n] for row, n in zip(out, counts, strict=True)]


def generate(
    model: CausalLM,
    prompt: Sequence | np.ndarray | Array,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    temperature: float | int = 1.0,
    top_k: int | None = None,
    top_p: float | int | None = None,
    min_p: float | int | None = None,
    repetition_penalty: float | int | None = None,
    stop_tokens: Sequence | np.ndarray = (),
) -> np.ndarray:
    """Continue one prompt of token ids: the new tokens (int32), ending at a stop token if one
    was produced. Same key, same output. See `generate_batch` for the arguments."""
    (out,) = generate_batch(
        model,
        [prompt],
        max_new_tokens=max_new_tokens,
        key=_single_key(key),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        stop_tokens=stop_tokens,
    )
    return out


def stream(
    model: CausalLM,
    prompt: Sequence | np.ndarray | Array,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    temperature: float | int = 1.0,
    top_k: int | None = None,
    top_p: float | int | None = None,
    min_p: float | int | None = None,
    repetition_penalty: float | int | None = None,
    stop_tokens: Sequence | np.ndarray = (),
    chunk: int = 16,
) -> Iterator[np.ndarray]:
    """`generate` one prompt, yielding new tokens as they are produced, `chunk` at a time.

    The cache holds the whole context, so the compiled pieces depend only on the prompt's
    bucket and `chunk`: new prompts and new settings reuse them. The tokens yielded, joined,
    equal `generate`'s output for the same arguments.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    settings = sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    tokens, positions, stop, _ = _prepare(model, [prompt], max_new_tokens, stop_tokens)
    keys = _single_key(key)
    model = cast_floating(model, dtype_of(model.config.compute_dtype))
    layers = unstack_layers(model.blocks, model.config.n_layers)
    slots = cache_slots(model, model.config.max_seq_len)
    limit = jnp.asarray(max_new_tokens, jnp.int32)
    state, first = _prefill_compiled(
        model, layers, tokens, positions, keys, settings, stop, limit, slots=slots
    )
    yield np.asarray(first)
    while int(state.step) < max_new_tokens and not bool(state.done[0]):
        state, out = _decode_chunk((model, layers, settings, stop), state, steps=chunk)
        out = np.asarray(out)[0]
        yield out[out != NO_TOKEN]
