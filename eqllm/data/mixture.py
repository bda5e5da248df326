"""Weighted mixtures of corpora: each source tokenized once into its own cache, every batch a pure
function of (seed, step).

Row r of step s's global batch comes from the source that the point
``u = frac(seed * sqrt(2) + (s * batch_size + r + 1) * (sqrt(5) - 1) / 2)`` falls into when [0, 1)
is cut into intervals as long as the normalised weights (a Weyl sequence, the golden-ratio
low-discrepancy sequence). Its points spread evenly over [0, 1), so over any run of n rows each
source's realised share is within about log(n) / n of its weight (`share_tolerance`), with no
random drift and nothing to save for an exact resume. The window of each row is then drawn from
its source as `batch_at` draws one, from ``default_rng([seed, step, source])``.

A schedule of weights (`stages`, as Levanter's staged mixtures) replaces the weights from a given
step on; the Weyl sequence runs on unchanged, so the shares within each stage keep the same
bound, and the batch of step s stays a pure function of (seed, s).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .batches import _check_length, _check_shard
from .errors import DataError
from .sources import DataSource
from .tokenizer import Tokenizer
from .tokens import Split, TokenData, prepare

_GOLDEN = (math.sqrt(5) - 1) / 2


def share_tolerance(rows: int) -> float:
    """A bound on |realised share - weight| for any source over `rows` consecutive rows
    (the Weyl sequence's discrepancy, at most (1 + ln rows) / rows up to a small constant; the
    test checks it)."""
    return 3 * (1 + math.log(max(rows, 1))) / max(rows, 1)


def row_sources(weights: np.ndarray, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """The source index of every row of step `step`'s global batch."""
    bounds = np.cumsum(weights / weights.sum())
    index = step * batch_size + np.arange(batch_size, dtype=np.float64) + 1
    u = np.mod(seed * math.sqrt(2) + index * _GOLDEN, 1.0)
    return np.minimum(np.searchsorted(bounds, u, side="right"), len(weights) - 1)


@dataclasses.dataclass
class MixtureData:
    """Several prepared corpora with one tokenizer, sampled by weight (see module docstring).

    Attributes:
        sources: each source's `TokenData` (its own cache folder).
        labels: each source's name in metrics and reports.
        weights: each source's weight (positive; normalised when sampling).
        stages: ``(first_step, weights)`` pairs, steps increasing from 1: from ``first_step`` on
            the rows are drawn with these weights (each >= 0, not all 0) instead.
    """

    sources: list[TokenData]
    labels: list[str]
    weights: np.ndarray
    stages: tuple[tuple[int, Sequence[float] | np.ndarray], ...] = ()

    def __post_init__(self):
        if not self.sources:
            raise DataError("a mixture needs at least one source in data.sources")
        ids = {(d.tokenizer.to_str(), d.tokenizer.eot_id) for d in self.sources}
        if len(ids) != 1:
            raise DataError("the sources of a mixture must share one tokenizer")
        self.weights = np.asarray(self.weights, np.float64)
        stages, last = [], 0
        for i, (start, weights) in enumerate(self.stages):
            where = f"data.weight_schedule[{i}]"
            weights = np.asarray(weights, np.float64)
            if not isinstance(start, int) or start <= last:
                raise DataError(
                    f"{where}: step={start!r} must be an int above {last} (the stages start at "
                    "increasing steps; step 0 uses the sources' own weights)"
                )
            if weights.shape != self.weights.shape or (weights < 0).any() or weights.sum() <= 0:
                raise DataError(
                    f"{where}: weights={weights.tolist()} must be {len(self.weights)} numbers, "
                    "one per source in data.sources order, each >= 0 and not all 0"
                )
            stages.append((start, weights))
            last = start
        self.stages = tuple(stages)

    def weights_at(self, step: int) -> np.ndarray:
        """The weights rows of step `step` are drawn with (the last stage begun, else
        `weights`)."""
        current = self.weights
        for start, weights in self.stages:
            if step >= start:
                current = weights
        return current

    @property
    def tokenizer(self) -> Tokenizer:
        return self.sources[0].tokenizer

    @property
    def meta(self) -> dict:
        """Token, byte and document counts summed over the sources, and each source's."""
        keys = [f"{s}_{c}" for s in ("train", "val") for c in ("tokens", "bytes", "docs")]
        total = {k: sum(int(d.meta[k]) for d in self.sources) for k in keys}
        total["weight_schedule"] = [
            {"step": start, "weights": weights.tolist()} for start, weights in self.stages
        ]
        total["sources"] = {
            label: {"weight": float(w), "path": str(d.path), **{k: d.meta[k] for k in keys}}
            for label, w, d in zip(self.labels, self.weights, self.sources, strict=True)
        }
        return total

    @property
    def train(self) -> np.ndarray:
        """Every source's training tokens laid end to end (read into memory: for statistics
        such as the unigram baseline on small corpora)."""
        return np.concatenate([np.asarray(d.train) for d in self.sources])

    @property
    def val(self) -> np.ndarray:
        """Every source's validation tokens laid end to end."""
        return np.concatenate([np.asarray(d.val) for d in self.sources])

    def bytes_per_token(self, split: Split = "train") -> float:
        meta = self.meta
        if meta[f"{split}_tokens"] == 0:
            raise DataError(f"the {split} split of the mixture is empty; it has no bytes/token")
        return meta[f"{split}_bytes"] / meta[f"{split}_tokens"]

    def batch_at(
        self,
        *,
        step: int,
        seed: int,
        batch_size: int,
        seq_len: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> np.ndarray:
        """This process's rows of step `step`'s global batch, as `eqllm.data.batch_at`."""
        rows = _check_shard(batch_size, process_index, process_count)
        if step < 0 or seed < 0:
            raise DataError(f"step={step} and seed={seed} must be non-negative ints.")
        which = row_sources(self.weights_at(step), seed=seed, step=step, batch_size=batch_size)
        mine = np.zeros(batch_size, bool)
        mine[rows] = True
        out = np.empty((batch_size, seq_len + 1), np.int32)
        for i, data in enumerate(self.sources):
            picked = np.flatnonzero(which == i)
            if not len(picked):
                continue
            _check_length(data.train, seq_len, f"training ({self.labels[i]})")
            rng = np.random.default_rng([seed, step, i])
            # Offsets are drawn for the whole global batch (the same on every process); only
            # this process's rows are read from the token file.
            starts = rng.integers(0, data.train.shape[0] - seq_len, size=len(picked))
            keep = mine[picked]
            out[picked[keep]] = data.train[starts[keep, None] + np.arange(seq_len + 1)]
        return out[rows]


def prepare_mixture(
    sources: list[tuple[str, DataSource, float]],
    tokenizer: str | Tokenizer,
    *,
    seq_len: int,
    stages: tuple[tuple[int, Sequence[float]], ...] = (),
    **prepare_args,
) -> MixtureData:
    """Tokenize each (label, source, weight) into its own cache (`eqllm.data.prepare`, with
    `prepare_args`) and return the mixture. A "bpe" tokenizer is trained on the first source
    and used for the others; `stages` is `MixtureData.stages`. Errors name the source:
    `data.sources[i] ('label')`."""
    prepared: list[TokenData] = []
    for i, (label, source, weight) in enumerate(sources):
        where = f"data.sources[{i}] ({label!r})"
        if not weight > 0:
            raise DataError(f"{where}: weight={weight} must be > 0 (its share of the rows)")
        tok = prepared[0].tokenizer if prepared else tokenizer
        try:
            if next(iter(source.documents()), None) is None:
                raise DataError(f"{source.describe()} yields no documents; fix or remove it")
            data = prepare(source, tok, **prepare_args)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        if data.train.shape[0] < seq_len + 1:
            raise DataError(
                f"{where}: {data.train.shape[0]} training tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}; give the source more text or leave it out"
            )
        prepared.append(data)
    labels = [label for label, _, _ in sources]
    weights = np.array([w for _, _, w in sources], np.float64)
    return MixtureData(prepared, labels, weights, tuple((s, np.asarray(w)) for s, w in stages))
