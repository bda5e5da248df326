"""Packing variable-length examples into full rows with segment ids, instead of one padded row
per example.

`pack_examples` places each example whole into a row of `seq_len + 1` tokens, greedily: "first-fit"
takes the first row with room, "best-fit" the row whose room is the smallest that fits (Johnson,
1973; the packing of Krell et al., 2021, and of Levanter's and MaxText's SFT pipelines). Each
example keeps its tokens and its loss mask; the targets that would cross from one example into
the next are masked out, and `segment_ids` keep attention inside each example, so with positions
restarting per example (`eqllm.data.segments.document_positions`) every example computes what it
computes padded alone and the mean loss over the same examples is the same.

Any data made of (token ids, per-token loss mask) pairs can use it: instruction examples here,
preference pairs later.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from .errors import DataError

PACK_METHODS = ("first-fit", "best-fit")


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of packed examples.

    Attributes:
        rows: [n, seq_len + 1] token ids (the tail of a row is `pad_id`).
        mask: [n, seq_len], True where target `rows[:, 1:]` is trained: an example's own loss
            mask, never a target in another example or in the padding.
        segment_ids: [n, seq_len + 1], the example each token belongs to within its row
            (0, 1, ...); the padding tail has an id of its own.
        truncated: examples cut to seq_len + 1 tokens.
        filled_tokens: token slots that hold an example.
    """

    rows: np.ndarray
    mask: np.ndarray
    segment_ids: np.ndarray
    truncated: int
    filled_tokens: int

    @property
    def padding_fraction(self) -> float:
        """The share of the rows' token slots that hold no example."""
        return 1.0 - self.filled_tokens / max(self.rows.size, 1)


def assign_rows(lengths: Sequence[int], capacity: int, method: str) -> list[list[int]]:
    """Indices of the examples in each row, greedily, in the examples' order.

    Arguments:
        lengths: tokens of each example (each at most `capacity`).
        capacity: tokens per row.
        method: "first-fit" or "best-fit".
    """
    if method not in PACK_METHODS:
        raise DataError(f"packing method {method!r} is not one of {list(PACK_METHODS)}")
    rows: list[list[int]] = []
    room: list[int] = []
    by_room: list[tuple[int, int]] = []  # (room, row) sorted: best-fit's search
    for i, n in enumerate(lengths):
        if not 0 < n <= capacity:
            raise DataError(f"example {i} has {n} tokens; a row holds 1 to {capacity}")
        if method == "first-fit":
            row = next((r for r, free in enumerate(room) if free >= n), None)
        else:
            at = bisect.bisect_left(by_room, (n, -1))
            row = by_room.pop(at)[1] if at < len(by_room) else None
        if row is None:
            row = len(rows)
            rows.append([])
            room.append(capacity)
        rows[row].append(i)
        room[row] -= n
        if method == "best-fit":
            bisect.insort(by_room, (room[row], row))
    return rows


def pack_examples(
    encoded: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    method: str = "best-fit",
) -> Packed:
    """Pack (token ids, token loss mask) examples into rows of seq_len + 1 tokens.

    An example longer than seq_len + 1 tokens is cut to that length (as padding does). Token
    t + 1's mask entry says whether target t + 1 is trained; it is kept only when token t
    belongs to the same example.
    """
    cut = [(ids[: seq_len + 1], m[: seq_len + 1]) for ids, m in encoded]
    truncated = sum(len(ids) > seq_len + 1 for ids, _ in encoded)
    plan = assign_rows([len(ids) for ids, _ in cut], seq_len + 1, method)
    rows = np.full((len(plan), seq_len + 1), pad_id, np.int64)
    token_mask = np.zeros((len(plan), seq_len + 1), bool)
    segments = np.zeros((len(plan), seq_len + 1), np.int32)
    for r, members in enumerate(plan):
        at = 0
        for s, i in enumerate(members):
            ids, m = cut[i]
            rows[r, at : at + len(ids)] = ids
            token_mask[r, at : at + len(ids)] = m
            segments[r, at : at + len(ids)] = s
            at += len(ids)
        segments[r, at:] = len(members)  # the padding tail: a segment of its own
    same = segments[:, 1:] == segments[:, :-1]
    filled = sum(len(ids) for ids, _ in cut)
    return Packed(rows, token_mask[:, 1:] & same, segments, truncated, filled)
