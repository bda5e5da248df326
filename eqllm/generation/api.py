"""The public generation API: `generate`, `generate_batch` and `stream`, on the engine.

Prompts are checked here; each call then makes an `Engine` just large enough for its prompts
(a slot each, and blocks for prompt + new tokens) and runs it to the end: every prompt is
prefilled in one call (left-padded to a power-of-two bucket), then every row decodes in one
call that loops on device until each row has its tokens or a stop token. The compiled steps
are shared with every other engine over a model of the same structure, so a new call of the
same shape compiles nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Key, PRNGKeyArray

from eqllm.generation.engine import Engine
from eqllm.generation.requests import Params, Token
from eqllm.generation.sampling import GenerationError, sampling
from eqllm.generation.sizing import MIN_CHUNK, chunk_for
from eqllm.model import CausalLM

MIN_BUCKET = MIN_CHUNK


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
    """Checked prompts (int32 arrays) and stop ids."""
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
    return rows, tuple(stop.tolist())


def _engine(
    model: CausalLM, rows, *, max_len: int, steps: int, speculate=None, draft=None
) -> Engine:
    """An engine with a slot per row and the blocks of `max_len` positions for each, taking
    every prompt in one prefill call where its memory allows (`sizing.chunk_for`) and decoding
    `steps` tokens per call (one speculative round per call when `speculate`)."""
    width = bucket(max(len(r) for r in rows), model.config.max_seq_len)
    return Engine(
        model,
        max_batch=len(rows),
        max_len=max_len,
        max_queue=len(rows),  # every prompt is queued before the first step
        prefill_chunk=chunk_for(model.config, width * len(rows), max_len),
        kv_blocks=len(rows) * -(-max_len // 16),
        block_size=16,
        prefix_cache=False,
        decode_steps=1 if speculate else steps,
        speculate=speculate,
        draft=draft,
    )


def _params(max_new_tokens, settings: dict, stop: tuple[int, ...], adapter: int = 0) -> Params:
    return Params(max_tokens=max_new_tokens, stop_tokens=stop, adapter=adapter, **settings)


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
    speculate: int | None = None,
    draft: CausalLM | None = None,
    adapter: int | Sequence[int] = 0,
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
        speculate: speculative decoding with K guesses per round (None: off). Greedy output is
            the same token for token; sampled output has the same distribution (not the same
            draws). See `eqllm.generation.speculate`.
        draft: the model that guesses (sharing the vocabulary; None: prompt lookup, guesses
            copied from earlier in the sequence).
        adapter: for a model holding stacked LoRA adapters
            (`eqllm.generation.adapters.stack_adapters`), the adapter of every prompt or one
            per prompt (0: the base model).

    Returns:
        One int32 array of new tokens per prompt.

    Raises:
        GenerationError: a bad prompt, key or setting.
    """
    settings = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sampling(**settings)
    rows, stop = _prepare(model, prompts, max_new_tokens, stop_tokens)
    keys = _row_keys(key, len(rows))
    longest = max(len(r) for r in rows)
    max_len = min(
        bucket(longest, model.config.max_seq_len) + max_new_tokens, model.config.max_seq_len
    )
    engine = _engine(
        model,
        rows,
        max_len=max_len,
        steps=max(1, max_new_tokens - 1),
        speculate=speculate,
        draft=draft,
    )
    outputs: list[list[int]] = [[] for _ in rows]
    chosen = [adapter] * len(rows) if isinstance(adapter, int) else list(adapter)
    if len(chosen) != len(rows):
        raise GenerationError(f"adapter: give one index or one per prompt ({len(rows)})")
    for row, key_i, out, a in zip(rows, keys, outputs, chosen, strict=True):
        params = _params(max_new_tokens, settings, stop, a)
        engine.submit(row, params, _tokens_into(out), key=key_i)
    engine.run(max_rounds=4 + len(rows) + max_new_tokens)
    return [np.asarray(out, np.int32) for out in outputs]


def _tokens_into(out: list[int]):
    def sink(event):
        if isinstance(event, Token):
            out.append(event.id)

    return sink


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
    speculate: int | None = None,
    draft: CausalLM | None = None,
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
        speculate=speculate,
        draft=draft,
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
    settings = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sampling(**settings)
    rows, stop = _prepare(model, [prompt], max_new_tokens, stop_tokens)
    key = _single_key(key)[0]
    engine = _engine(model, rows, max_len=model.config.max_seq_len, steps=chunk)
    out: list[int] = []
    engine.submit(rows[0], _params(max_new_tokens, settings, stop), _tokens_into(out), key=key)
    engine.step(decode=False)  # the prompt, and the first token
    sent = len(out)
    yield np.asarray(out, np.int32)
    for _ in range(max_new_tokens):  # a round decodes at least one token
        if not engine.busy():
            return
        engine.step()
        yield np.asarray(out[sent:], np.int32)
        sent = len(out)
