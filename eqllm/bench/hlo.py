"""Reading a compiled program's optimised HLO text: its collectives and how often a step runs them.

One parser for what CPU, GPU and TPU compilers emit (`Program`):
- computations and the calls between them (fusions, calls, conditionals, async wrappers, while
  loops), so an op inside a fusion inside a loop body is found and counted with the loop;
- loop trip counts, from `known_trip_count` where the compiler records it (CPU), else from the
  loop's own condition (`counter < N`), the counter's start and its increment (TPU);
- collectives in every form: plain ops (`all-gather(`), async pairs (`all-gather-start(` /
  `-done(`: the start counts, once), ops wrapped in an async computation (counted through its
  `async-start` only), TPU's `async-collective-start` / `-done` fusion pairs (the same op twice:
  the done half, marked by its `AsyncCollectiveDone` custom call, is skipped), TPU's
  continuation fusions of one async collective (clones that keep its `channel_id`) and TPU's
  all-reduce-scatter fusions (an all-reduce whose fusion keeps only the device's slice: a
  reduce-scatter on the chip). The TPU compiler also writes some reduce-scatters and
  all-gathers as windowed einsums, rings of collective-permutes overlapped with the matrix
  product, and writes all-gathers on a full torus as all-reduces of zero-filled buffers: those
  keep their op's kind, marked with the collective they implement (`implements`).

XLA's own cost analysis (`compiled.cost_analysis()`) counts each loop body once, whatever its
trip count; `Program.loop_factor` measures, from the HLO, by how much the loops multiply the
program's FLOPs or bytes, to scale that figure to one whole step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

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
    """

    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group: tuple[int, ...]
    runs: int
    calls: int
    implements: str = ""

    @property
    def result_bytes(self) -> int:
        return sum(_bytes(t, d) for t, d in self.shapes)


def count_collectives(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) counts of each collective kind in optimised HLO text.

    "Per layer" counts the ops in while-loop bodies (the scanned layers, forward and backward),
    each once; "per step" multiplies every op by the trip counts of the loops around it.
    """
    return tally(Program(hlo).collectives(), lambda c: 1)


def collective_bytes(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) bytes of each collective kind's results (see `count_collectives`);
    an async `-start` op counts its results, not the operands its tuple repeats."""
    return tally(Program(hlo).collectives(), lambda c: c.result_bytes)


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The distinct shapes (per device, after the gather) that the HLO's all-gathers produce."""
    return gathered(Program(hlo).collectives())


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


class Program:
    """Optimised HLO text, parsed once: computations, calls and how often one step runs each."""

    def __init__(self, hlo: str):
        self.comps, self.roots, self.entry = _computations(hlo)
        # callee -> [(caller, trips, whether the callee is that loop's body, fusion call)]
        self.edges: dict[str, list[tuple[str, int, bool, bool]]] = {}
        for name, body in self.comps.items():
            for line in body.values():
                if _ASYNC_HALF.search(line):
                    continue  # async-done/-update name the computation async-start already ran
                loop = _WHILE.search(line)
                trips = self._trip_count(line, name) if loop else 1
                fused = bool(_FUSION.search(line))
                for callee in _callees(line):
                    if callee in self.comps:
                        is_body = loop is not None and callee == loop.group(1)
                        self.edges.setdefault(callee, []).append((name, trips, is_body, fused))
        self.runs = functools.cache(self._runs)
        self.in_loop = functools.cache(self._in_loop)
        self.fused = functools.cache(self._fused)
        self.ring = functools.cache(self._ring)

    def _runs(self, comp: str, per_pass: bool = False) -> int:
        """Times one step runs `comp`; with `per_pass`, each loop body counts once."""
        if comp == self.entry:
            return 1
        return sum(
            self.runs(caller, per_pass) * (1 if per_pass and body else trips)
            for caller, trips, body, _ in self.edges.get(comp, ())
        )

    def _in_loop(self, comp: str) -> bool:
        return any(body or self.in_loop(c) for c, _, body, _ in self.edges.get(comp, ()))

    def _ring(self, comp: str) -> str:
        """The collective a windowed-einsum loop implements, for `comp` and what it calls: XLA's
        SPMD partitioner names those loop bodies windowed_dot_general_body_rs (reduce-scatter)
        and _ag (all-gather)."""
        for suffix, kind in (("_rs", "reduce-scatter"), ("_ag", "all-gather")):
            if f"windowed_dot_general_body{suffix}" in comp:
                return kind
        return next((r for c, _, _, _ in self.edges.get(comp, ()) if (r := self.ring(c))), "")

    def _fused(self, comp: str) -> bool:
        """Whether `comp` runs inside a fusion (its values stay on chip, not in HBM)."""
        calls = self.edges.get(comp, ())
        return bool(calls) and all(fused or self.fused(c) for c, _, _, fused in calls)

    def collectives(self) -> list[Collective]:
        """Every collective op, with how often a step runs it (see the module docstring)."""
        skip = {n for n, body in self.comps.items() if _ASYNC_DONE in "".join(body.values())}
        found, channels = [], set()
        for name, body in self.comps.items():
            runs = self.runs(name) if name not in skip else 0
            if not runs:
                continue
            calls = self.runs(name, True) if self.in_loop(name) else 0
            root = body.get(self.roots.get(name), "")
            for op, line in body.items():
                for kind in KINDS:
                    if not _OP[kind].search(line):
                        continue
                    channel = re.search(r"\bchannel_id=(\d+)", line)
                    if channel and channel.group(1) in channels:
                        continue  # the same op again: a continuation of an async collective
                    channels |= {channel.group(1)} if channel else set()
                    shapes = tuple(_result_shapes(line, kind))
                    if kind == "all-reduce" and _operands(root, "dynamic-slice")[:1] == [op]:
                        # TPU's all-reduce-scatter fusion: each device keeps its slice of the
                        # sum, which the chip runs as a reduce-scatter
                        kind = "reduce-scatter"
                        shapes = tuple(_result_shapes(root, "dynamic-slice"))
                    implements = ""
                    if kind == "collective-permute":
                        implements = self.ring(name)
                    elif kind == "all-reduce" and any(
                        "dynamic-update-slice" in arg or body.get(arg, "").find(_DUS) >= 0
                        for arg in _operands(line, "all-reduce")
                    ):
                        implements = "all-gather"
                    group = _replica_group(line)
                    found.append(Collective(kind, shapes, group, runs, calls, implements))
        return found

    def loop_factor(self, what: str) -> float:
        """By how much the loops' trip counts multiply the program's "flops" (its matrix
        products: dots and convolutions) or "bytes" (what the unfused ops read and write),
        against counting every loop body once, as XLA's cost analysis does. 1.0 without
        loops."""
        measure = self._flops if what == "flops" else self._hbm_bytes
        whole = once = 0.0
        for name, body in self.comps.items():
            if what == "bytes" and self.fused(name):
                continue
            cost = sum(measure(body, text) for text in body.values())
            if cost:
                whole += cost * self.runs(name)
                once += cost * self.runs(name, True)
        return whole / once if once else 1.0

    @staticmethod
    def _flops(body: dict[str, str], text: str) -> float:
        result = _first_shape(text)
        if result is None:
            return 0.0
        if (args := _operands(text, "dot")) and args[0] in body:
            lhs = _first_shape(body[args[0]])
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", text)
            if lhs is None or not dims:
                return 0.0
            inner = math.prod(lhs[1][int(i)] for i in dims.group(1).split(",") if i)
            return 2.0 * math.prod(result[1]) * inner
        if (args := _operands(text, "convolution")) and len(args) > 1:
            lhs, rhs = (_first_shape(body.get(a, "")) for a in args[:2])
            return _convolution_flops(text, lhs, rhs) if lhs and rhs else 0.0
        return 0.0

    @staticmethod
    def _hbm_bytes(body: dict[str, str], text: str) -> float:
        opcode = re.search(r"\s([a-z][\w\-]*)\(", text)
        if opcode is None or opcode.group(1) in _NO_TRAFFIC:
            return 0.0
        moved = sum(_bytes(t, d) for t, d in _shapes(text[: opcode.start()]))
        for arg in _operands(text, opcode.group(1)):
            moved += sum(_bytes(t, d) for t, d in _shapes(_type_of(body.get(arg, ""))))
        return float(moved)

    def _trip_count(self, line: str, comp: str) -> int:
        """A while loop's trip count: recorded by the compiler, else read from `counter < N` in
        its condition, the counter's start in the loop's initial tuple and its step in the
        body; 1 when the loop is not of that form."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if known:
            return int(known.group(1))
        named = dict(re.findall(r"\b(condition|body)=%?([\w.\-]+)", line))
        condition = self.comps.get(named.get("condition"), {})
        body = self.comps.get(named.get("body"), {})
        for text in condition.values():
            compare = re.search(r"direction=(LT|LE|GT|GE)", text)
            args = _operands(text, "compare")
            if not compare or len(args) != 2:
                continue
            direction = compare.group(1)
            counter, bound = args if direction in ("LT", "LE") else args[::-1]
            limit = _constant(condition, bound)
            index = re.search(r"index=(\d+)", condition.get(counter, ""))
            if limit is None or index is None:
                continue
            index = int(index.group(1))
            start = 0
            init = _operands(line, "while")
            elements = _operands(self.comps[comp].get(init[0], ""), "tuple") if init else []
            if index < len(elements):
                start = _constant(self.comps[comp], elements[index]) or 0
            step = 1
            updated = _operands(body.get(self.roots.get(named.get("body")), ""), "tuple")
            if index < len(updated):
                added = _operands(body.get(updated[index], ""), "add")
                step = next((s for s in (_constant(body, a) for a in added) if s), 1)
            span = limit - start + (1 if direction in ("LE", "GE") else 0)
            return max(0, -(-span // step))
        return 1


_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
# "kind(" or "kind-start(" as the op, not "%kind.12" as an operand
_OP = {kind: re.compile(rf"(?<![\w%.\-]){kind}(-start)?\(") for kind in KINDS}
_ASYNC_DONE = 'custom_call_target="AsyncCollectiveDone"'
_DUS = " dynamic-update-slice("
_ASYNC_HALF = re.compile(r"(?<![\w%.\-])async-(done|update)\(")
_WHILE = re.compile(r"(?<![\w%.\-])while\(.*\bbody=%?([\w.\-]+)")
_FUSION = re.compile(r"(?<![\w%.\-])fusion\(")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# Ops that move no HBM bytes of their own (views, bookkeeping, control flow whose bodies are
# counted themselves, and the start/done halves of copies and collectives).
_NO_TRAFFIC = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "copy-start", "copy-done",
    "async-start", "async-done", "opt-barrier", "iota",
}  # fmt: skip


def _convolution_flops(text: str, lhs, rhs) -> float:
    """FLOPs of a convolution as XLA's cost analysis counts them: 2 per multiply-add, over the
    (output position, window tap) pairs of each spatial dimension that land on real input
    (not padding, not the holes of a dilated input). TPU HLO writes matrix products as such
    convolutions."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", text)
    if not labels:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = _first_shape(text)[1]
    found = re.search(r"window=\{([^}]*)\}", text)
    window = dict(re.findall(r"(\w+)=([\dx_]+)", found.group(1) if found else ""))
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    sizes = [int(n) for n in window.get("size", "").split("x") if n]
    pairs = 1
    for i, dim in enumerate(spatial):
        size = sizes[i] if i < len(sizes) else 1
        stride, lhs_dilate, rhs_dilate = (
            int(window[key].split("x")[i]) if key in window else 1
            for key in ("stride", "lhs_dilate", "rhs_dilate")
        )
        low = int(window["pad"].split("x")[i].split("_")[0]) if "pad" in window else 0
        n_in, n_out = lhs[1][lhs_labels.index(dim)], out[out_labels.index(dim)]
        taps = np.arange(n_out)[:, None] * stride - low + np.arange(size)[None, :] * rhs_dilate
        real = (taps % lhs_dilate == 0) & (taps >= 0) & (taps // lhs_dilate < n_in)
        pairs *= int(real.sum())
    groups = int((re.search(r"feature_group_count=(\d+)", text) or [0, 1])[1])
    batch_groups = int((re.search(r"batch_group_count=(\d+)", text) or [0, 1])[1])
    features = lhs[1][lhs_labels.index("f")] // groups
    batch = lhs[1][lhs_labels.index("b")] // batch_groups
    return 2.0 * batch * features * rhs[1][rhs_labels.index("o")] * pairs


def _bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return _DTYPE_BYTES.get(dtype, 4) * math.prod(dims)


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(n) for n in d.split(",") if n)) for t, d in _SHAPE.findall(text)]


def _type_of(text: str) -> str:
    """The result type of an instruction's text (what precedes its opcode)."""
    opcode = re.search(r"\s[a-z][\w\-]*\(", text)
    return text[: opcode.start()] if opcode else ""


def _first_shape(text: str) -> tuple[str, tuple[int, ...]] | None:
    shapes = _shapes(_type_of(text))
    return shapes[0] if shapes else None


def _computations(hlo: str) -> tuple[dict[str, dict[str, str]], dict[str, str], str]:
    """{computation: {instruction name: its text after "="}}, {computation: its root
    instruction} and the entry computation's name."""
    comps: dict[str, dict[str, str]] = {}
    roots: dict[str, str] = {}
    entry, name = "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(2)
            comps.setdefault(name, {})
            entry = name if header.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                comps[name][instruction.group(2)] = instruction.group(3)
                if instruction.group(1):
                    roots[name] = instruction.group(2)
    return comps, roots, entry


def _callees(line: str) -> list[str]:
    names = re.findall(
        r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)",
        line,
    )
    for group in re.findall(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}", line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _operands(text: str, opcode: str) -> list[str]:
    """The operand names of `opcode(...)` in an instruction's text."""
    found = re.search(rf"(?<![\w%.\-]){opcode}\(([^)]*)\)", text)
    if not found:
        return []
    inner = re.sub(r"/\*.*?\*/", "", found.group(1))
    return [o.strip().lstrip("%") for o in inner.split(",") if o.strip()]


def _constant(comp: dict[str, str], name: str) -> int | None:
    """The integer value of instruction `name`, following copies and conversions."""
    for _ in range(8):
        text = comp.get(name)
        if text is None:
            return None
        value = re.search(r"(?<![\w%.\-])constant\((-?\d+)\)", text)
        if value:
            return int(value.group(1))
        passes = ("copy", "bitcast", "convert", "reshape")
        passed = next((ops for op in passes if (ops := _operands(text, op))), None)
        if not passed:
            return None
        name = passed[0]
    return None


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
    shapes = _shapes(line[: op.start()])  # "f32[8,4]{1,0} all-gather(...)": the result first
    if op.group(1):  # -start: (operands..., results..., scalar contexts...)
        while shapes and shapes[-1][1] == () and shapes[-1][0] in ("u32", "s32"):
            shapes = shapes[:-1]
        shapes = shapes[len(shapes) // 2 :]
    return shapes
