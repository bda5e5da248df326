"""Reading a compiled program's optimised HLO text: its computations and how often a step runs each.

One parser for what CPU, GPU and TPU compilers emit (`Program`):
- computations and the calls between them (fusions, calls, conditionals, async wrappers, while
  loops), so an op inside a fusion inside a loop body is found and counted with the loop;
- loop trip counts, from `known_trip_count` where the compiler records it (CPU), else from the
  loop's own condition (`counter < N`), the counter's start and its increment (TPU).
`eqllm.bench.collectives` finds the collectives among its ops.

XLA's own cost analysis (`compiled.cost_analysis()`) counts each loop body once, whatever its
trip count; `Program.loop_factor` measures, from the HLO, by how much the loops multiply the
program's FLOPs or bytes, to scale that figure to one whole step.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator

import numpy as np


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

    def _fused(self, comp: str) -> bool:
        """Whether `comp` runs inside a fusion (its values stay on chip, not in HBM)."""
        calls = self.edges.get(comp, ())
        return bool(calls) and all(fused or self.fused(c) for c, _, _, fused in calls)

    def costs(
        self, what: str, per_pass: bool = False, skip: Callable[[str, str], bool] | None = None
    ) -> Iterator[tuple[str, float]]:
        """(instruction text, its "flops" or "bytes" per step) for every op that has some:
        "flops" the matrix products (dots and convolutions), "bytes" what the unfused ops read
        from and write to HBM, counted by XLA's rules; loops at their trip counts, or with
        `per_pass` each loop body once, as XLA's cost analysis counts. `skip(instruction,
        text)` leaves ops out (kernels counted on their own)."""
        measure = self._flops if what == "flops" else self._hbm_bytes
        for name, body in self.comps.items():
            if what == "bytes" and self.fused(name):
                continue
            for instruction, text in body.items():
                if skip is not None and skip(instruction, text):
                    continue
                if cost := measure(body, text):
                    yield text, cost * self.runs(name, per_pass)

    def total(
        self, what: str, per_pass: bool = False, skip: Callable[[str, str], bool] | None = None
    ) -> float:
        """The program's "flops" or "bytes" per step (`costs`, summed)."""
        return sum(cost for _, cost in self.costs(what, per_pass, skip))

    def loop_factor(self, what: str, skip: Callable[[str, str], bool] | None = None) -> float:
        """By how much the loops' trip counts multiply the program's "flops" or "bytes"
        (`total`) against counting every loop body once, as XLA's cost analysis does: the
        factor that scales its figure to one step. 1.0 without loops."""
        once = self.total(what, True, skip)
        return self.total(what, False, skip) / once if once else 1.0

    @staticmethod
    def _flops(body: dict[str, str], text: str) -> float:
        result = _first_shape(text)
        if result is None:
            return 0.0
        if (args := operands(text, "dot")) and args[0] in body:
            lhs = _first_shape(body[args[0]])
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", text)
            if lhs is None or not dims:
                return 0.0
            inner = math.prod(lhs[1][int(i)] for i in dims.group(1).split(",") if i)
            return 2.0 * math.prod(result[1]) * inner
        if (args := operands(text, "convolution")) and len(args) > 1:
            lhs, rhs = (_first_shape(body.get(a, "")) for a in args[:2])
            return _convolution_flops(text, lhs, rhs) if lhs and rhs else 0.0
        return 0.0

    def _hbm_bytes(self, body: dict[str, str], text: str) -> float:
        """HBM bytes an unfused op reads and writes, as XLA's cost analysis counts them: a
        slice reads only what it takes; a dynamic-update-slice, in place, writes only its
        update (a fusion's too, where its root is one); a kernel with a cost estimate counts
        the bytes the estimate gives."""
        opcode = re.search(r"\s([a-z][\w\-]*)\(", text)
        if opcode is None or opcode.group(1) in _NO_TRAFFIC:
            return 0.0
        op, result = opcode.group(1), _size(text[: opcode.start()])
        if op == "custom-call" and (estimate := KERNEL_BYTES.search(text)):
            return float(estimate.group(1))
        args = operands(text, op)
        if op in ("slice", "dynamic-slice"):
            return 2.0 * result
        if op == "dynamic-update-slice":
            return 2.0 * _size(_type_of(body.get(args[1], ""))) if len(args) > 1 else result
        callee = next(iter(_callees(text)), "") if op == "fusion" else ""
        fused = self.comps.get(callee)
        if not fused:
            return float(result + sum(_size(_type_of(body.get(a, ""))) for a in args))
        root = self.roots.get(callee, "")
        outputs = operands(fused.get(root, ""), "tuple") or [root]
        written = sum(_written(fused, fused.get(out, "")) for out in outputs)
        params = [n for n, t in fused.items() if re.search(r"(?<![\w%.\-])parameter\(\d+\)", t)]
        return float(written + sum(_read(fused, name) for name in params))

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
            args = operands(text, "compare")
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
            init = operands(line, "while")
            elements = operands(self.comps[comp].get(init[0], ""), "tuple") if init else []
            if index < len(elements):
                start = _constant(self.comps[comp], elements[index]) or 0
            step = 1
            updated = operands(body.get(self.roots.get(named.get("body")), ""), "tuple")
            if index < len(updated):
                added = operands(body.get(updated[index], ""), "add")
                step = next((s for s in (_constant(body, a) for a in added) if s), 1)
            span = limit - start + (1 if direction in ("LE", "GE") else 0)
            return max(0, -(-span // step))
        return 1


_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
# A kernel's own estimate of the bytes it moves (Mosaic custom calls' backend config).
KERNEL_BYTES = re.compile(r'"cost_estimate":\{[^}]*?"bytes_accessed":"?(\d+)')
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


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of an array of this HLO dtype and shape."""
    return _DTYPE_BYTES.get(dtype, 4) * math.prod(dims)


def shapes_of(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every (dtype, dims) written in `text`, in order."""
    return [(t, tuple(int(n) for n in d.split(",") if n)) for t, d in _SHAPE.findall(text)]


def _size(text: str) -> int:
    """Bytes of every array type written in `text`."""
    return sum(nbytes(t, d) for t, d in shapes_of(text))


def _written(fused: dict[str, str], text: str) -> int:
    """Bytes a fusion output writes: a dynamic-update-slice writes its update in place."""
    if args := operands(text, "dynamic-update-slice"):
        return _size(_type_of(fused.get(args[1], "")))
    return _size(_type_of(text))


def _read(fused: dict[str, str], param: str) -> int:
    """Bytes a fusion reads of parameter `param` (XLA's FusionParameterReadBytes): what its
    slices take, nothing where it is the buffer a dynamic-update-slice writes in place, the
    whole array for any other use (once)."""
    size, whole = 0, False
    for text in fused.values():
        opcode = re.search(r"\s([a-z][\w\-]*)\(", text)
        args = operands(text, opcode.group(1)) if opcode else []
        if param not in args:
            continue
        op = opcode.group(1)
        if op == "slice" or (op == "dynamic-slice" and args[0] == param):
            size += _size(_type_of(text))
        elif op == "dynamic-update-slice" and args[0] == param:
            continue
        elif not whole:
            whole = True
            size += _size(_type_of(fused[param]))
    return size


def _type_of(text: str) -> str:
    """The result type of an instruction's text (what precedes its opcode)."""
    opcode = re.search(r"\s[a-z][\w\-]*\(", text)
    return text[: opcode.start()] if opcode else ""


def _first_shape(text: str) -> tuple[str, tuple[int, ...]] | None:
    shapes = shapes_of(_type_of(text))
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


def operands(text: str, opcode: str) -> list[str]:
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
        passed = next((ops for op in passes if (ops := operands(text, op))), None)
        if not passed:
            return None
        name = passed[0]
    return None
