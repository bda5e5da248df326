"""Deterministic batches from a token array.

`batch_at` is a pure function of (seed, step): the training loop keeps no iterator state, so a run
resumed at step s sees exactly the batches an uninterrupted run sees. The global batch does not
depend on the number of processes; each process takes its own contiguous block of rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .errors import DataError


def _check_shard(batch_size: int, process_index: int, process_count: int) -> slice:
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size} must be positive.")
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise DataError(
            f"process_index={process_index} must be in [0, process_count={process_count})."
        )
    if batch_size % process_count:
        raise DataError(
            f"The global batch_size={batch_size} does not divide evenly over "
            f"process_count={process_count} processes; use a multiple of {process_count}."
        )
    per = batch_size // process_count
    return slice(process_index * per, (process_index + 1) * per)


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if seq_len <= 0:
        raise DataError(f"seq_len={seq_len} must be positive.")
    if tokens.ndim != 1:
        raise DataError(f"tokens must be a 1-D array of token ids, got shape {tokens.shape}.")
    if tokens.shape[0] < seq_len + 1:
        raise DataError(
            f"The {what} token array holds {tokens.shape[0]} tokens, fewer than seq_len + 1 = "
            f"{seq_len + 1} needed for one window; use a shorter seq_len or more data "
            "(a larger max_bytes or val_fraction)."
        )


def batch_at(
    tokens: np.ndarray,
    *,
    step: int,
    seed: int,
    batch_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """The training batch of `step`: windows at random offsets drawn from (seed, step).

    Arguments:
        tokens: 1-D token ids (e.g. ``TokenData.train``).
        step, seed: non-negative ints; the offsets come from ``np.random.default_rng([seed,
            step])``, so the batch is a pure function of them.
        batch_size: the global batch size (rows over all processes).
        seq_len: tokens per model input.
        process_index, process_count: this process's share of the global batch, rows
            ``[i * b, (i + 1) * b)`` with ``b = batch_size // process_count``.

    Returns:
        int32 array of shape ``(batch_size // process_count, seq_len + 1)``; inputs are
        ``[:, :-1]`` and targets ``[:, 1:]``.
    """
    rows = _check_shard(batch_size, process_index, process_count)
    _check_length(tokens, seq_len, "training")
    if step < 0 or seed < 0:
        raise DataError(f"step={step} and seed={seed} must be non-negative ints.")
    rng = np.random.default_rng([seed, step])
    # Offsets for the whole global batch are drawn on every process, then sliced: the global
    # batch is the same whatever process_count is.
    starts = rng.integers(0, tokens.shape[0] - seq_len, size=batch_size)[rows]
    window = starts[:, None] + np.arange(seq_len + 1)
    return np.asarray(tokens[window], dtype=np.int32)


def eval_batches(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Consecutive windows covering `tokens`: every token after the first is a target once.

    Window k is ``tokens[k * seq_len : k * seq_len + seq_len + 1]`` (consecutive windows share one
    token: the last target of one is the first input of the next). The last window and the last
    batch are padded to full shape with token 0, and the mask says which targets are real, so
    shapes stay static (no recompiles) and no token is dropped.

    Yields:
        ``(batch, mask)``: int32 ``(rows, seq_len + 1)`` and bool ``(rows, seq_len)``, where
        ``mask[r, t]`` is True when target ``batch[r, t + 1]`` is real and
        ``rows = batch_size // process_count`` (this process's share, as in `batch_at`).
        At most `max_batches` batches.
    """
    rows = _check_shard(batch_size, process_index, process_count)
    _check_length(tokens, seq_len, "evaluation")
    n_targets = tokens.shape[0] - 1
    n_windows = -(-n_targets // seq_len)
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    offsets = np.arange(seq_len + 1)
    for b in range(n_batches):
        window_ids = b * batch_size + np.arange(batch_size)[rows]
        starts = window_ids * seq_len
        index = starts[:, None] + offsets
        valid = index < tokens.shape[0]
        batch = np.zeros(index.shape, dtype=np.int32)
        batch[valid] = tokens[index[valid]]
        yield batch, valid[:, 1:]
