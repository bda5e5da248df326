"""Applying a family's key table (`eqllm.families.Family.table`) to a model's arrays."""

from __future__ import annotations

import re

from eqllm import families
from eqllm.families import Row

# Non-parameter buffers some checkpoints carry: read past, never needed.
BUFFERS = re.compile(r"(.*\.attn\.(bias|masked_bias)|.*\.rotary_emb\.inv_freq)$")

TIED_HEAD = "lm_head.weight"


def rows_for(family: str, leaves: set[str], table: tuple[Row, ...] | None = None) -> list[Row]:
    """The rows of `family`'s table (or of `table`, one of its layouts) that the model with these
    leaf paths has.

    Rows naming arrays the model lacks (biases, an untied head) are skipped. Raises if a leaf is
    held by no row (a table out of step with the model code).
    """
    table = families.get(family).table if table is None else table
    rows = [r for r in table if all(p in leaves for p in r.eqllm)]
    partial = [r for r in table if r not in rows and any(p in leaves for p in r.eqllm)]
    covered = {p for r in rows for p in r.eqllm}
    if partial or covered != leaves:
        raise AssertionError(
            f"{family} key table does not match the model: uncovered {sorted(leaves - covered)}, "
            f"partly present {[r.hf for r in partial]}"
        )
    return rows


def indices(row: Row, n_layers: int, n_experts: int | None) -> list[tuple[int, ...]]:
    """The leading indices (layer, expert) of each tensor a row stands for; () for one tensor."""
    layers = [(i,) for i in range(n_layers)] if row.layered else [()]
    if not row.per_expert:
        return layers
    return [(*i, j) for i in layers for j in range(n_experts or 0)]


def tensor_name(row: Row, index: tuple[int, ...]) -> str:
    """The tensor's name at leading indices `index` (see `indices`)."""
    named = dict(zip(("i", "j") if row.layered else ("j",), index, strict=False))
    return row.hf.format(**named)
