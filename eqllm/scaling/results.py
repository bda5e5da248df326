"""Reading a results file: one JSON object a line with at least params, tokens, flops and loss.

`eqllm sweep` writes such a file (results.jsonl); any other source of points works if it has
those four keys. Rows marked `"diverged": true` or with a non-finite loss are left out of fits.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eqllm.errors import EqllmError

REQUIRED = ("params", "tokens", "flops", "loss")


class FitError(EqllmError):
    """A results file a scaling-law fit cannot use (missing keys, too few points or budgets)."""


@dataclass(frozen=True)
class Points:
    """Runs as arrays of equal length: parameters N, training tokens D, FLOPs C and final loss."""

    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray

    def __len__(self) -> int:
        return len(self.loss)

    def take(self, index) -> Points:
        """The points at `index` (a boolean mask or integer indices)."""
        return Points(self.params[index], self.tokens[index], self.flops[index], self.loss[index])

    @classmethod
    def of(cls, params, tokens, flops, loss) -> Points:
        """Points from four sequences of numbers."""
        arrays = [np.asarray(x, dtype=np.float64) for x in (params, tokens, flops, loss)]
        return cls(*arrays)


def read_results(path: str | os.PathLike) -> Points:
    """The usable points of a results file (diverged and non-finite rows dropped)."""
    path = Path(path)
    if not path.is_file():
        raise FitError(f"results file {str(path)!r} does not exist; give a results.jsonl path")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise FitError(f"{path}:{i} is not a JSON object; each line must be one") from None
        if not isinstance(row, dict):
            raise FitError(f"{path}:{i} is not a JSON object; each line must be one")
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise FitError(
                f"{path}:{i} lacks {', '.join(missing)}; each line needs "
                f"{', '.join(REQUIRED)} (numbers)"
            )
        if row.get("diverged"):
            continue
        values = [row[k] for k in REQUIRED]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise FitError(f"{path}:{i}: {', '.join(REQUIRED)} must be numbers, got {values}")
        if not all(math.isfinite(v) for v in values):
            continue
        if min(values[:3]) <= 0 or values[3] <= 0:
            raise FitError(f"{path}:{i}: params, tokens, flops and loss must be positive")
        rows.append(values)
    if not rows:
        raise FitError(f"{path} has no usable rows (all diverged, non-finite or empty)")
    return Points.of(*zip(*rows, strict=True))


def group_budgets(flops: np.ndarray, tolerance: float = 0.1) -> list[np.ndarray]:
    """Indices of points grouped by compute budget, smallest budget first.

    A group starts at the smallest remaining FLOPs and takes every point within `tolerance`
    (10%) above it.
    """
    order = np.argsort(flops, kind="stable")
    groups: list[list[int]] = []
    start = None
    for i in order:
        if start is None or flops[i] > start * (1 + tolerance):
            groups.append([])
            start = flops[i]
        groups[-1].append(int(i))
    return [np.asarray(g) for g in groups]
