"""Batched scoring and generation for harness requests, on eqllm's forward and generation engine.

Requests are sorted by length and cut into length buckets (powers of two from 16, capped at the
context), each bucket into batches of a fixed number of rows, so every (bucket, batch size) pair
compiles once. Rows are right-padded; padding has position -1, which the model masks out, so a
padded row scores exactly as it would alone. Nothing here imports lm_eval.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqllm.generation import bucket, generate_batch
from eqllm.model import CausalLM


@eqx.filter_jit
def _score(
    model: CausalLM,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"],
) -> tuple[Float[Array, " batch"], Bool[Array, " batch"]]:
    """Per row: the summed log-probability of `targets` where `mask`, and whether each of those
    targets is the argmax (lm_eval's `is_greedy`). Log-softmax in fp32, as the reference does."""
    logits = model(tokens, positions).astype(jnp.float32)
    # log_softmax at the targets only: no second [batch, seq, vocab] array
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    total = jnp.sum(jnp.where(mask, picked, 0.0), axis=-1)
    greedy = jnp.all(jnp.where(mask, jnp.argmax(logits, axis=-1) == targets, True), axis=-1)
    return total, greedy


def _batches(lengths: Sequence[int], batch_size: int, max_length: int) -> list[tuple[int, list]]:
    """(bucket width, row indices) batches: longest first, at most `batch_size` rows each."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[tuple[int, list]] = []
    for i in order:
        width = bucket(lengths[i], max_length)
        if out and out[-1][0] == width and len(out[-1][1]) < batch_size:
            out[-1][1].append(i)
        else:
            out.append((width, [i]))
    return out


def score(
    model: CausalLM,
    rows: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    max_length: int,
) -> list[tuple[float, bool]]:
    """(log-likelihood, is_greedy) of the last `n` tokens of each `(tokens, n)` row.

    Each token list holds context + continuation, already cut to at most `max_length + 1`
    tokens; the model reads all but the last one. Identical rows are computed once.
    """
    unique: dict[tuple, int] = {}
    keys = [(tuple(int(t) for t in toks), int(n)) for toks, n in rows]
    for key in keys:
        unique.setdefault(key, len(unique))
    items = list(unique)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(items)
    for width, idx in _batches([len(t) - 1 for t, _ in items], batch_size, max_length):
        tokens = np.zeros((batch_size, width), np.int32)
        positions = np.full((batch_size, width), -1, np.int32)  # -1: padding (also empty rows)
        targets = np.zeros((batch_size, width), np.int32)
        mask = np.zeros((batch_size, width), bool)
        for r, i in enumerate(idx):
            toks, n = items[i]
            length = len(toks) - 1
            tokens[r, :length] = toks[:-1]
            positions[r, :length] = np.arange(length)
            targets[r, :length] = toks[1:]
            mask[r, length - n : length] = True
        total, greedy = _score(model, tokens, positions, targets, mask)
        total, greedy = np.asarray(total), np.asarray(greedy)
        for r, i in enumerate(idx):
            results[i] = (float(total[r]), bool(greedy[r]))
    return [results[unique[key]] for key in keys]


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    stop_tokens: Sequence[int],
    key: Array,
    **settings,
) -> list[np.ndarray]:
    """New tokens for each prompt (ending at a stop token if one was produced).

    Prompts are sorted by length and generated `batch_size` at a time; a short last batch is
    filled with copies of its first prompt, so every batch has the same shape.
    """
    max_length = model.config.max_seq_len
    out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(prompts)
    for n, (_, idx) in enumerate(_batches([len(p) for p in prompts], batch_size, max_length)):
        batch = [list(prompts[i]) for i in idx]
        batch += [batch[0]] * (batch_size - len(batch))
        new = generate_batch(
            model,
            batch,
            max_new_tokens=max_new_tokens,
            key=jax.random.fold_in(key, n),
            stop_tokens=stop_tokens,
            **settings,
        )
        for r, i in enumerate(idx):
            out[i] = new[r]
    return out
