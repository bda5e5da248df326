"""The public generation API: `generate`, `generate_batch` and `stream`.

Prompts are checked here, then padded on the left to a power-of-two bucket, so a batch of
different lengths shares one compilation and the last column holds every row's next-token
logits. Padding has negative positions: the cache drops it and the attention mask hides it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Key, PRNGKeyArray

from eqllm.generation.loop import (
    NO_TOKEN,
    decode_chunk,
    generate_compiled,
    prefill_compiled,
)
from eqllm.generation.sampling import GenerationError, sampling
from eqllm.model import CausalLM, cast_floating, dtype_of

MIN_BUCKET = 16


def bucket(length: int, max_seq_len: int) -> int:
    """The padded prompt length: the next power of two (at least 16), at most the context."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_seq_len)


def _as_prompt(prompt, row: int, vocab: int) -> np.ndarray:
    ids = np.asarray(prompt)
    if ids.ndim != 1:
        raise GenerationError(
            f"prompt {row} must be a 1-D sequence of token ids, got shape {ids.shape}; "
            "for several prompts use generate_batch"
        )
    if ids.size == 0:
        raise GenerationError(f"prompt {row} is empty; give at least one token to continue from")
    if not np.issubdtype(ids.dtype, np.integer):
        raise GenerationError(f"prompt {row} must hold integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise GenerationError(f"prompt {row} has token ids outside [0, vocab_size={vocab})")
    return ids.astype(np.int32)


def _typed_key(key) -> Array:
    key = jnp.asarray(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key from jax.random.PRNGKey
    return key


def _single_key(key) -> Key[Array, " 1"]:
    key = _typed_key(key)
    if key.shape != ():
        raise GenerationError(
            f"key must be a single PRNG key, got an array of shape {key.shape}; "
            "use generate_batch for one key per prompt"
        )
    return key[None]


def _row_keys(key, batch: int) -> Key[Array, " batch"]:
    key = _typed_key(key)
    if key.shape == ():
        return jax.random.split(key, batch)
    if key.shape == (batch,):
        return key
    raise GenerationError(
        f"key must be one PRNG key or one per prompt ({batch}), got shape {key.shape}"
    )


def _prepare(model, prompts, max_new_tokens, stop_tokens):
    """Checked, left-padded prompts: (tokens, positions, stop ids) as numpy arrays."""
    if not isinstance(model, CausalLM):
        raise GenerationError(f"model must be an eqllm CausalLM, got {type(model).__name__}")
    cfg = model.config
    if len(prompts) == 0:
        raise GenerationError("no prompts given; pass at least one prompt")
    rows = [_as_prompt(p, i, cfg.vocab_size) for i, p in enumerate(prompts)]
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens:
        raise GenerationError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    longest = max(len(r) for r in rows)
    if longest > cfg.max_seq_len:
        raise GenerationError(
            f"a prompt of {longest} tokens is longer than the context "
            f"max_seq_len={cfg.max_seq_len}; shorten it"
        )
    if longest + max_new_tokens > cfg.max_seq_len:
        raise GenerationError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the context max_seq_len={cfg.max_seq_len}; "
            f"lower max_new_tokens to at most {cfg.max_seq_len - longest} or shorten the prompt"
        )
    stop = np.asarray(list(stop_tokens), np.int32).reshape(-1)
    if stop.size and (stop.min() < 0 or stop.max() >= cfg.vocab_size):
        raise GenerationError(
            f"stop_tokens must be token ids in [0, vocab_size={cfg.vocab_size}), "
            f"got {stop.tolist()}"
        )
    # Padded with an id no token has, to a multiple of 8: a few more stops do not recompile.
    stop = np.pad(stop, (0, 8 * max(1, -(-len(stop) // 8)) - len(stop)), constant_values=-1)
    width = bucket(longest, cfg.max_seq_len)
    tokens = np.zeros((len(rows), width), np.int32)
    positions = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):  # left padding: every prompt ends in the last column
        tokens[i, width - len(r) :] = r
        positions[i, width - len(r) :] = np.arange(len(r))
    return tokens, positions, stop


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
        top_k: see `filter_logits`.
        top_p: see `filter_logits`.
        min_p: see `filter_logits`.
        repetition_penalty: see `penalize_repetition`.
        stop_tokens: a row ends after producing one of these (it is included in the output).

    Returns:
        One int32 array of new tokens per prompt.

    Raises:
        GenerationError: a bad prompt, key or setting.
    """
    settings = sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    tokens, positions, stop = _prepare(model, prompts, max_new_tokens, stop_tokens)
    keys = _row_keys(key, len(tokens))
    out, counts = generate_compiled(
        model, tokens, positions, keys, settings, stop, max_new_tokens=max_new_tokens
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

    The decode loop runs compiled `chunk` tokens per call, its state (cache included) donated
    between calls, so Python prints between chunks at one dispatch per chunk rather than a host
    callback per token. The cache holds the whole context, so the compiled pieces depend only
    on the prompt's bucket and `chunk`: new prompts and new settings reuse them. The tokens
    yielded, joined, equal `generate`'s output for the same arguments.
    """
    if isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1:
        raise GenerationError(f"chunk must be a positive integer, got {chunk!r}")
    settings = sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    tokens, positions, stop = _prepare(model, [prompt], max_new_tokens, stop_tokens)
    keys = _single_key(key)
    model = cast_floating(model, dtype_of(model.config.compute_dtype))
    layers = model.layers()  # once: both compiled pieces take them
    limit = jnp.asarray(max_new_tokens, jnp.int32)
    length = model.config.max_seq_len
    state, first = prefill_compiled(
        model, layers, tokens, positions, keys, settings, stop, limit, length=length
    )
    yield np.asarray(first)
    while int(state.step) < max_new_tokens and not bool(state.done[0]):
        state, out = decode_chunk((model, layers, settings, stop), state, steps=chunk)
        out = np.asarray(out)[0]
        yield out[out != NO_TOKEN]
