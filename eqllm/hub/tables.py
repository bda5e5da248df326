"""Applying a family's key table (`eqllm.families.Family.table`) to a model's arrays."""

from __future__ import annotations

import re

import numpy as np

from eqllm import families
from eqllm.config.kinds import stack_layers as layers_of
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
    experts = any(p.endswith(".mlp.router.weight") for p in leaves)
    table = [r for r in table if r.experts in (None, experts)]  # see `Row.experts`
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


def stack_layers(row: Row, config) -> tuple[int, ...]:
    """The model's layer index of each layer of the stack a layered row fills (`dense_blocks`,
    `blocks` or `linear_blocks`, by the row's first eqllm path), in order: one entry per layer
    of that stack (`eqllm.config.kinds.stack_layers`); none for a stack the model lacks."""
    field = row.eqllm[0].split(".", 1)[0]
    return layers_of(config).get(field, ())


def tensor_name(row: Row, index: tuple[int, ...], layers: tuple[int, ...] | None = None) -> str:
    """The tensor's name at leading indices `index` (see `indices`) of a stack whose layers
    are the model's layers `layers` (None: the same numbers, `stack_layers`)."""
    named = dict(zip(("i", "j") if row.layered else ("j",), index, strict=False))
    if row.layered and layers is not None:
        named["i"] = layers[named["i"]]
    if row.parts:  # one name per part: see `part_names`
        named["part"] = "{part}"
    return row.hf.format(**named)


def part_names(row: Row, name: str) -> list[str]:
    """The tensor names of a row stored as several tensors (`Row.parts`), else [name]."""
    return [name.replace("{part}", part) for part, _ in row.parts] or [name]


def fused_order(row: Row, sizes: list[int], n_heads: int) -> np.ndarray | None:
    """Where each entry of a fused tensor's axis comes from: the HF tensor is the eqllm parts
    (of `sizes` along the fused axis) concatenated, then taken in this order along `row.axis`.

    None for parts stored one after the other; for a `per_head` row, head h's slice of every
    part in turn ([n_heads, parts, size / n_heads]); for an `interleaved` row, entry i of every
    part in turn ([size, parts]). Undo it with `np.argsort`.
    """
    if not (row.per_head or row.interleaved) or len(sizes) < 2:
        return None
    if row.interleaved:
        if len(set(sizes)) > 1:
            raise AssertionError(f"{row.hf}: interleaved parts {sizes} differ in size")
        return np.arange(sum(sizes)).reshape(len(sizes), -1).T.reshape(-1)
    if any(size % n_heads for size in sizes):
        raise AssertionError(f"{row.hf}: parts {sizes} do not split into {n_heads} heads")
    starts = np.cumsum([0, *sizes[:-1]])
    return np.concatenate(
        [
            np.arange(start + h * (size // n_heads), start + (h + 1) * (size // n_heads))
            for h in range(n_heads)
            for start, size in zip(starts, sizes, strict=True)
        ]
    )


def hf_shape(row: Row, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of one HF tensor of a row, given the eqllm shapes (per tensor) it holds."""
    shape = list(shapes[0])
    shape[row.axis] = sum(s[row.axis] for s in shapes)
    if row.transposed:
        shape[-2:] = shape[-1:-3:-1]
    if row.depthwise:
        shape.insert(1, 1)
    return tuple(shape[::-1] if row.conv1d else shape)


def axis_slice(tensor: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """`tensor[start:stop]` along `axis` (one part of a row stored as several tensors)."""
    return tensor[(slice(None),) * axis + (slice(start, stop),)]
