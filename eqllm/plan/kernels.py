"""The grouped matmuls of a compiled step: what the compiler counts, and what the chip runs.

On TPU a mixture of experts' grouped matmuls are Mosaic kernels (megablox's gmm and tgmm;
XLA's own ragged-dot kernels), `tpu_custom_call`s whose backend config carries the kernel's
cost estimate, `"cost_estimate": {"flops": ...}`: 2 x rows x d_in x d_out over every row of the
block it is given. The token dispatch's dropless blocks (`eqllm.nn.dispatch`) hold
`n_shards x slot_rows` rows of which the routed copies fill, on the mean chip, exactly the
copies each chip sends (tokens x k: the exchange moves copies, it makes none), the rest being
padding; the kernels' grid covers only the row tiles that hold a group's rows
(`num_active_tiles`, from the group sizes at run time), so the padding is not computed. A
compile cannot know the group sizes, so its FLOPs and bytes are a static bound;
`grouped_cost` splits the kernels out of them and says what their routed rows run. (A kernel's
bytes are its estimate's too: megablox re-reads an expert's weights for every row tile.)
"""

from __future__ import annotations

import dataclasses
import math
import re

from eqllm.bench.hlo import KERNEL_BYTES, Program, shapes_of
from eqllm.nn.dispatch import slot_rows
from eqllm.sharding.rules import RULES

_COST = re.compile(r'"cost_estimate":\{[^}]*?"flops":"?(\d+)')
_PALLAS = re.compile(r"jit\((\w+)\)/pallas_call")


@dataclasses.dataclass(frozen=True)
class GroupedKernel:
    """One grouped-matmul kernel call of the program: its name ("gmm", "tgmm", ...), the rows
    of its block, its cost estimate per call (FLOPs and bytes), and how often a step runs it
    (`runs`, loops at their trip counts) and XLA's cost analysis counts it (`once`, each loop
    body once)."""

    name: str
    rows: int
    flops: float
    bytes: float
    runs: int
    once: int


def kernel_name(instruction: str, text: str) -> str | None:
    """The grouped-matmul kernel that `instruction` (its name and text) calls, a custom call
    with a cost estimate (megablox's "gmm" or "tgmm", XLA's ragged dot), else None."""
    if "custom-call(" not in text or not _COST.search(text):
        return None
    pallas = _PALLAS.search(text)
    name = pallas.group(1) if pallas else re.sub(r"\.\d+$", "", instruction)
    return name if "gmm" in name or "ragged" in name else None


def grouped_kernels(program: Program) -> list[GroupedKernel]:
    """The program's grouped-matmul custom calls that carry a cost estimate. A kernel's rows:
    gmm's result is (rows, d_out); tgmm's (groups, d_in, d_out), its rows the estimate over
    2 x d_in x d_out."""
    found = []
    for comp, body in program.comps.items():
        for instruction, text in body.items():
            name = kernel_name(instruction, text)
            shapes = shapes_of(text[: text.index("custom-call(")]) if name else []
            if not shapes:
                continue
            flops, dims = float(_COST.search(text).group(1)), shapes[0][1]
            moved = float(m.group(1)) if (m := KERNEL_BYTES.search(text)) else 0.0
            rows = dims[0] if len(dims) == 2 else round(flops / (2 * math.prod(dims[1:])))
            runs, once = program.runs(comp), program.runs(comp, True)
            found.append(GroupedKernel(name, rows, flops, moved, runs, once))
    return found


@dataclasses.dataclass(frozen=True)
class GroupedCost:
    """A step's grouped-matmul kernels per chip: their FLOPs `static` (the cost estimates, every
    row of each block), `once` (each loop body counted once: what XLA's cost analysis holds of
    them) and `run` (what the routed rows run on the mean chip); their bytes the same three
    ways; `block` and `routed`: the dispatch's rows per block and the routed copies in it (None:
    no padded block)."""

    static: float = 0.0
    once: float = 0.0
    run: float = 0.0
    static_bytes: float = 0.0
    once_bytes: float = 0.0
    run_bytes: float = 0.0
    block: int | None = None
    routed: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def dispatch_block(config, sizes: dict[str, int], rows: int) -> tuple[int, int] | None:
    """(rows of each grouped matmul's block, routed copies in it on the mean chip) where
    `config`'s experts are dispatched over the mesh of `sizes` with `rows` tokens a chip (per
    micro-batch): `n_shards x slot_rows`, and tokens x k of them routed (at most the block: with
    a capacity factor the copies past it are dropped). None where no block is padded: each
    chip's own rows (one shard: a block of exactly tokens x k), dense experts, no experts."""
    moe = config.moe
    if moe is None or moe.impl != "dispatch":
        return None
    shards = sizes[RULES["expert"]]
    if shards == 1 or moe.n_experts % shards:
        return None
    k = moe.experts_per_token
    block = shards * slot_rows(rows, k, moe.n_experts // shards, shards, moe.capacity_factor)
    return block, min(rows * k, block)


def grouped_cost(program: Program, block: tuple[int, int] | None) -> GroupedCost:
    """The grouped kernels' FLOPs and bytes in `program`: static, once, and run, where a kernel
    over the dispatch's padded `block` (`dispatch_block`) runs its routed rows only (its row
    tiles, and the weights each re-reads, scale with them); any other kernel counts as its
    estimate says."""
    kernels = grouped_kernels(program)
    rows = {"block": block and block[0], "routed": block and block[1]}
    if not kernels:
        return GroupedCost(**rows)

    def share(k: GroupedKernel) -> float:
        return block[1] / block[0] if block and k.rows == block[0] else 1.0

    totals = {}
    for unit, cost in (("", lambda k: k.flops), ("_bytes", lambda k: k.bytes)):
        totals["static" + unit] = sum(cost(k) * k.runs for k in kernels)
        totals["once" + unit] = sum(cost(k) * k.once for k in kernels)
        totals["run" + unit] = sum(cost(k) * k.runs * share(k) for k in kernels)
    return GroupedCost(**totals, **rows)
