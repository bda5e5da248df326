"""A roofline estimate of a compiled step's time on a TPU slice: an upper bound on its MFU.

Per chip, each resource takes at least:
- compute: the compiled program's FLOPs (XLA's cost analysis, scaled to the loops' trip counts)
  at the chip's peak bf16 rate;
- memory: its bytes accessed at the chip's HBM bandwidth;
- communication: every collective's bytes on the wire, over the links its devices span. A group
  along d dimensions of the chip grid uses 2 links per dimension that closes into a ring (one
  each way; 1 where the dimension is a line) at the one-way link bandwidth; all-gather and
  all-to-all move (n-1)/n of their result, reduce-scatter (n-1) times its result, all-reduce
  2(n-1)/n (a reduce-scatter and an all-gather), collective-permute its result once. A group
  that spans k slices sends (k-1)/(n-1) of those bytes over the data-center network at the
  chip's share of it; what the TPU compiler sends between slices through the megascale runtime
  (`Collective.dcn`) goes there whole;
- the host link: what remat "offload" moves to the host's memory and back, over PCIe.
The step takes at least the longest of these (everything else overlapped perfectly), so the
MFU this implies (the model's FLOPs, without remat's recomputation, over chips x peak x that
time) is an upper bound; their sum (nothing overlapped) gives the lower figure beside
it. Latency, launch overheads and imperfect overlap are not modelled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eqllm.bench.collectives import Collective
from eqllm.sharding import MESH_AXES
from eqllm.sharding.tpu import TpuSlice


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Seconds per step by resource, the bound they imply and the MFU at that bound."""

    compute_s: float
    memory_s: float
    ici_s: float
    dcn_s: float
    host_s: float  # to the host's memory and back (remat "offload")
    mfu: float  # upper bound: the longest resource alone
    mfu_serial: float  # nothing overlapped: the resources one after another
    comm_by_axes: dict[str, float]  # seconds of communication by the mesh axes it runs over

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.ici_s, self.dcn_s, self.host_s)

    def to_dict(self) -> dict:
        """Plain values for --json and the experiment pages' results files."""
        return {
            **{k: getattr(self, k) for k in ("compute_s", "memory_s", "ici_s", "dcn_s", "host_s")},
            "step_s": self.step_s,
            "bound": self.bound,
            "mfu": self.mfu,
            "mfu_serial": self.mfu_serial,
            "comm_by_axes": self.comm_by_axes,
        }

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_s, "HBM": self.memory_s, "ICI": self.ici_s}
        times |= {"DCN": self.dcn_s, "host link": self.host_s}
        return max(times, key=times.get)


def wire_bytes(c: Collective, n: int) -> float:
    """Bytes one device sends (or receives) for collective `c` over a group of `n` devices."""
    if n <= 1:
        return 0.0
    size = float(c.result_bytes)
    return {
        "all-gather": size * (n - 1) / n,
        "all-to-all": size * (n - 1) / n,
        "reduce-scatter": size * (n - 1),
        "all-reduce": 2 * size * (n - 1) / n,
        "collective-permute": size,
    }[c.kind]


def estimate(
    tpu: TpuSlice,
    devices: list,
    mesh_shape: dict[str, int],
    collectives: list[Collective],
    *,
    flops: float,
    bytes_accessed: float,
    model_flops: float,
    offloaded: int = 0,
    grad_accum: int = 1,
) -> Roofline:
    """The roofline of one step: `flops` and `bytes_accessed` per chip, `model_flops` for the
    whole step on all chips, `collectives` of the program run over `devices` (the mesh's, in
    order; `mesh_shape` its axis sizes). `offloaded`: the bytes a chip keeps in its host's
    memory (the compiler's host temporaries), which each of the `grad_accum` micro-batches
    sends out in its forward pass and reads back in its backward pass."""
    chip = tpu.chip
    compute = flops / chip.peak_flops
    memory = bytes_accessed / chip.hbm_bandwidth
    host = 2 * offloaded * grad_accum / chip.host_link
    ici = dcn = 0.0
    by_axes: dict[str, float] = {}
    shape = [mesh_shape[a] for a in MESH_AXES]
    links_of = {}
    for c in collectives:
        if c.dcn:
            seconds = c.result_bytes * c.runs / chip.dcn_per_chip
            dcn += seconds
            by_axes["between slices"] = by_axes.get("between slices", 0.0) + seconds
            continue
        group = c.group or tuple(range(len(devices)))
        n = len(group) if c.kind != "collective-permute" else 2
        wire = wire_bytes(c, n) * c.runs
        if not wire:
            continue
        if group not in links_of:
            links_of[group] = _links(tpu, [devices[i] for i in group])
        links, slices = links_of[group]
        over_ici = wire / (links * chip.ici_link) if links else 0.0
        over_dcn = wire * (slices - 1) / (n - 1) / chip.dcn_per_chip
        ici, dcn = ici + over_ici, dcn + over_dcn
        if over_ici + over_dcn:
            axes = _axes(group, shape)
            by_axes[axes] = by_axes.get(axes, 0.0) + over_ici + over_dcn
    step = max(compute, memory, ici, dcn, host)
    peak = tpu.chips * chip.peak_flops
    return Roofline(
        compute_s=compute,
        memory_s=memory,
        ici_s=ici,
        dcn_s=dcn,
        host_s=host,
        mfu=model_flops / (peak * step) if step else 0.0,
        mfu_serial=model_flops / (peak * (compute + memory + ici + dcn + host)) if step else 0.0,
        comm_by_axes=by_axes,
    )


def _links(tpu: TpuSlice, group: list) -> tuple[int, int]:
    """(one-way links a device of `group` sends on inside its slice, slices the group spans)."""
    slices = {getattr(d, "slice_index", 0) for d in group}
    home = getattr(group[0], "slice_index", 0)
    first = [d for d in group if getattr(d, "slice_index", 0) == home]
    coords = np.array([d.coords for d in first])[:, : tpu.chip.torus_dims]
    spanned = [i for i in range(coords.shape[1]) if len(set(coords[:, i])) > 1]
    return sum(2 if tpu.wrap[i] else 1 for i in spanned), len(slices)


def _axes(group: tuple[int, ...], shape: list[int]) -> str:
    """The mesh axes along which `group`'s devices (flat mesh positions) differ."""
    index = np.array(np.unravel_index(np.array(group), shape))
    varying = [a for a, row in zip(MESH_AXES, index, strict=True) if len(set(row)) > 1]
    return ",".join(varying) or "none"
