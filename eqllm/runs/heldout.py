"""The held-out tokens a run evaluates on, kept in its folder so that `eqllm eval` needs no data.

Written when the run starts: the validation tokens its evaluation reads (the whole validation
split, or the prefix that `eval.batches` batches of windows cover, which gives the same numbers),
the split's bytes per token (for bits per byte), the unigram baseline's loss on the whole split,
and for a mixture each source's own validation tokens and bytes per token.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class HeldOutSource:
    """One mixture source's validation tokens and their bytes per token."""

    tokens: np.ndarray
    bytes_per_token: float


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """What a run's evaluation scores: `tokens` (a prefix of the validation split covering every
    window evaluation reads), `bytes_per_token` of the split, `unigram_loss` (nats/token of the
    add-one unigram model of the training split on the whole validation split; None when the
    split has no window), and `sources` (a mixture's sources by label)."""

    tokens: np.ndarray
    bytes_per_token: float
    unigram_loss: float | None = None
    sources: dict[str, HeldOutSource] = dataclasses.field(default_factory=dict)

    @staticmethod
    def evaluated(tokens: np.ndarray, *, batch_size: int, seq_len: int, batches: int) -> np.ndarray:
        """The prefix of `tokens` that `batches` batches of `batch_size` windows of `seq_len`
        targets read (all of them when `batches` is 0)."""
        if not batches:
            return np.asarray(tokens)
        return np.asarray(tokens[: batches * batch_size * seq_len + 1])

    def write(self, path: Path) -> None:
        """One .npz file (no pickled objects), written through a rename."""
        arrays = {
            "tokens": self.tokens,
            "bytes_per_token": np.float64(self.bytes_per_token),
            "unigram_loss": np.float64(
                math.nan if self.unigram_loss is None else self.unigram_loss
            ),
            "source_labels": np.asarray(list(self.sources), dtype=np.str_),
        }
        for i, source in enumerate(self.sources.values()):
            arrays[f"source{i}_tokens"] = source.tokens
            arrays[f"source{i}_bytes_per_token"] = np.float64(source.bytes_per_token)
        tmp = path.with_name(f".{path.name}.tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> HeldOut:
        with np.load(path, allow_pickle=False) as f:
            unigram = float(f["unigram_loss"])
            sources = {
                str(label): HeldOutSource(
                    f[f"source{i}_tokens"], float(f[f"source{i}_bytes_per_token"])
                )
                for i, label in enumerate(f["source_labels"])
            }
            return cls(
                f["tokens"],
                float(f["bytes_per_token"]),
                None if math.isnan(unigram) else unigram,
                sources,
            )
