"""The collectives of a compiled SPMD program (`eqllm.bench.hlo.Program`): each op's kind,
result shapes, replica group and how often a step runs it.

Collectives come in every form: plain ops (`all-gather(`), async pairs (`all-gather-start(` /
`-done(`: the start counts, once), ops wrapped in an async computation (counted through its
`async-start` only), TPU's `async-collective-start` / `-done` fusion pairs (the same op twice:
the done half, marked by its `AsyncCollectiveDone` custom call, is skipped), TPU's continuation
fusions of one async collective (clones that keep its `channel_id`) and TPU's all-reduce-scatter
fusions (an all-reduce whose fusion keeps only the device's slice: a reduce-scatter on the
chip). The TPU compiler also writes some reduce-scatters and all-gathers as windowed einsums,
rings of collective-permutes overlapped with the matrix product, and writes all-gathers on a
full torus as all-reduces of zero-filled buffers: those keep their op's kind, marked with the
collective they implement (`implements`). A program over several slices runs the part of a
collective that crosses them as a send to the megascale runtime over the data-center network
(`send(...), is_host_transfer=true, ... _xla_megascale_transfer_type="ALL_GATHER"`): each is
counted as its kind with `dcn` set, its bytes those the chip sends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import numpy as np

from eqllm.bench.hlo import Program, nbytes, operands, shapes_of

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled SPMD program, as one device runs it.

    Attributes:
        kind: one of KINDS.
        shapes: (dtype, dims) of its results on one device.
        group: the devices of its first replica group (positions in the program's device
            assignment, which is the mesh's devices in order); () when every device takes part.
        runs: how many times one step runs it (the trip counts of the loops around it).
        calls: how many times one pass through its loop bodies runs it (each body once);
            0 outside any loop.
        implements: the collective this op carries out in another form, "" for none: a
            collective-permute that is one step of a windowed einsum (the TPU compiler's
            reduce-scatter or all-gather done as a ring of permutes overlapped with the matrix
            product), or an all-reduce of a zero-filled buffer into which each device wrote its
            shard (an all-gather, as the TPU compiler writes it on a full torus).
        dcn: the part of a collective between slices, sent over the data-center network
            (`shapes`: what the chip sends; `group` ()).
    """

    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group: tuple[int, ...]
    runs: int
    calls: int
    implements: str = ""
    dcn: bool = False

    @property
    def result_bytes(self) -> int:
        return sum(nbytes(t, d) for t, d in self.shapes)


def count_collectives(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) counts of each collective kind in optimised HLO text.

    "Per layer" counts the ops in while-loop bodies (the scanned layers, forward and backward),
    each once; "per step" multiplies every op by the trip counts of the loops around it.
    """
    return tally(collectives(Program(hlo)), lambda c: 1)


def collective_bytes(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) bytes of each collective kind's results (see `count_collectives`);
    an async `-start` op counts its results, not the operands its tuple repeats."""
    return tally(collectives(Program(hlo)), lambda c: c.result_bytes)


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The distinct shapes (per device, after the gather) that the HLO's all-gathers produce."""
    return gathered(collectives(Program(hlo)))


def gathered(found: list[Collective]) -> list[tuple[int, ...]]:
    """The distinct shapes the all-gathers among `found` produce."""
    return sorted({d for c in found if c.kind == "all-gather" for _, d in c.shapes})


def tally(found: list[Collective], measure) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) sums of `measure(collective)` by kind (see `Collective`)."""
    per_layer, per_step = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
    for c in found:
        per_layer[c.kind] += measure(c) * c.calls
        per_step[c.kind] += measure(c) * c.runs
    return per_layer, per_step


def collectives(program: Program) -> list[Collective]:
    """Every collective op of `program`, with how often a step runs it (see the module
    docstring)."""
    ring = _rings(program)
    skip = {n for n, body in program.comps.items() if _ASYNC_DONE in "".join(body.values())}
    found, channels = [], set()
    for name, body in program.comps.items():
        runs = program.runs(name) if name not in skip else 0
        if not runs:
            continue
        calls = program.runs(name, True) if program.in_loop(name) else 0
        root = body.get(program.roots.get(name), "")
        for op, line in body.items():
            between = _MEGASCALE.search(line)
            if between:
                shapes = tuple(shapes_of(line[: between.start()])[:1])  # (payload, ctx, token)
                kind = _MEGASCALE_KINDS.get(between.group(1), "collective-permute")
                found.append(Collective(kind, shapes, (), runs, calls, dcn=True))
                continue
            for kind in KINDS:
                if not _OP[kind].search(line):
                    continue
                channel = _channel(line)
                if channel and channel in channels:
                    continue  # the same op again: a continuation of an async collective
                channels |= {channel} if channel else set()
                shapes = tuple(_result_shapes(line, kind))
                if kind == "all-reduce" and operands(root, "dynamic-slice")[:1] == [op]:
                    # TPU's all-reduce-scatter fusion: each device keeps its slice of the
                    # sum, which the chip runs as a reduce-scatter
                    kind = "reduce-scatter"
                    shapes = tuple(_result_shapes(root, "dynamic-slice"))
                implements = ""
                if kind == "collective-permute":
                    implements = ring(name)
                elif kind == "all-reduce" and any(
                    "dynamic-update-slice" in arg or body.get(arg, "").find(_DUS) >= 0
                    for arg in operands(line, "all-reduce")
                ):
                    implements = "all-gather"
                group = _replica_group(line)
                found.append(Collective(kind, shapes, group, runs, calls, implements))
    return found


def _rings(program: Program) -> Callable[[str], str]:
    """For each computation of `program`, the collective its windowed-einsum loop implements
    ("" for none), for it and what it calls: XLA's SPMD partitioner names those loop bodies
    windowed_dot_general_body_rs (reduce-scatter) and _ag (all-gather)."""

    @functools.cache
    def ring(comp: str) -> str:
        for suffix, kind in (("_rs", "reduce-scatter"), ("_ag", "all-gather")):
            if f"windowed_dot_general_body{suffix}" in comp:
                return kind
        return next((r for c, _, _, _ in program.edges.get(comp, ()) if (r := ring(c))), "")

    return ring


# "kind(" or "kind-start(" as the op, not "%kind.12" as an operand
_OP = {kind: re.compile(rf"(?<![\w%.\-]){kind}(-start)?\(") for kind in KINDS}
_ASYNC_DONE = 'custom_call_target="AsyncCollectiveDone"'
_MEGASCALE = re.compile(r' send\(.*is_host_transfer=true.*_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {
    "ALL_GATHER": "all-gather",
    "ALL_REDUCE": "all-reduce",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}  # another transfer type counts as a permute: what the chip sends, once
_DUS = " dynamic-update-slice("


def _channel(line: str) -> tuple[str, ...] | None:
    """What names one collective across the clones the TPU compiler makes of it: its
    channel_id with its source metadata (op_name, stack frame), which a clone keeps. The
    channel alone is not enough: `shard_map`'s collectives (the expert dispatch's all-to-alls,
    forward and backward) all carry channel_id=1. None for an op without a channel."""
    channel = re.search(r"\bchannel_id=(\d+)", line)
    if channel is None:
        return None
    source = re.search(r'metadata=\{op_name="([^"]*)"(?: stack_frame_id=(\d+))?', line)
    return (channel.group(1), *(source.groups("") if source else ("", "")))


def _replica_group(line: str) -> tuple[int, ...]:
    """The device ids of an op's first replica group (or of its first source-target pair);
    () when the op names no groups (every device takes part)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        grouped = set(re.findall(r"'(\w+)'", mesh.group(2)))
        ids = np.arange(math.prod(int(n) for _, n in axes)).reshape([int(n) for _, n in axes])
        index = tuple(slice(None) if a in grouped else 0 for a, _ in axes)
        return tuple(int(i) for i in ids[index].ravel())
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        groups = [int(n) for n in iota.group(1).split(",")]
        dims = [int(n) for n in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(n) for n in iota.group(3).split(",")])
        return tuple(int(i) for i in ids.reshape(groups[0], -1)[0])
    listed = re.search(r"(?:replica_groups|source_target_pairs)=\{\{([\d,]*)\}", line)
    if listed and listed.group(1):
        return tuple(int(i) for i in listed.group(1).split(","))
    return ()


def _result_shapes(line: str, kind: str) -> list[tuple[str, tuple[int, ...]]]:
    op = _OP[kind].search(line) if kind in _OP else re.search(rf" {kind}()\(", line)
    shapes = shapes_of(line[: op.start()])  # "f32[8,4]{1,0} all-gather(...)": the result first
    if op.group(1):  # -start: (operands..., results..., scalar contexts...)
        while shapes and shapes[-1][1] == () and shapes[-1][0] in ("u32", "s32"):
            shapes = shapes[:-1]
        shapes = shapes[len(shapes) // 2 :]
    return shapes
