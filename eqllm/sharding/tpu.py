"""TPU slices by the names the cloud gives them, and the figures of each chip.

Google Cloud names a slice by its chip generation and a count: `v5e-256` (also `v5litepod-256`)
and `v6e-256` count chips, while `v4-128` and `v5p-128` count TensorCores, two per chip
(v5p-128 is 64 chips). JAX names the same slice by its chips' physical layout: `v5p:4x4x4`,
`v5e:16x16`. `parse_slice` reads either spelling and gives the layout, the chip count and the
chip's figures (`CHIPS`), which `eqllm plan` uses for its per-chip memory limit and roofline
estimate. Nothing here needs a TPU or libtpu.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

from eqllm.errors import EqllmError


class TopologyError(EqllmError):
    """A TPU slice name that does not name a slice; the message lists what does."""


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation's chip: what the compiler and the roofline estimate need.

    peak_flops: dense bf16 FLOP/s. hbm_bytes: memory per chip. hbm_bandwidth: bytes/s.
    ici_link: one-way bytes/s of one inter-chip link. torus_dims: dimensions of the chip
    grid (two links per dimension, one each way). dcn_per_chip: bytes/s a chip's share of its
    host's data-center network gives, between slices. host_link: bytes/s each way between the
    chip and its host's memory (PCIe), which remat "offload" uses. cores_per_chip: TensorCores,
    which the cloud name of v4 and v5p slices counts. device_kind: what JAX reports for the chip.
    """

    name: str
    device_kind: str
    peak_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    ici_link: float
    torus_dims: int
    dcn_per_chip: float
    host_link: float
    cores_per_chip: int
    max_chips: int  # the largest single slice
    source: str


_CLOUD = "https://docs.cloud.google.com/tpu/docs/"
_BOOK = "https://jax-ml.github.io/scaling-book/tpus/ (ICI bandwidth per link, DCN per host)"
GiB = 2**30

# Peak, HBM and its bandwidth from each chip's Cloud TPU page; ICI one-way bandwidth per link
# from "How to Scale Your Model" (Austin et al., 2025), part 2, which agrees with the pages'
# bidirectional figure per chip (v5p: 1,200 GB/s = 6 links x 2 x 100 GB/s; v5e: 400 GB/s =
# 4 x 2 x 50; v6e: 800 GB/s = 4 x 2 x 100); DCN from the v5p page (50 Gbps per chip), the v5e
# page (2 x 100 Gbps per 8-chip host) and the book (25 GB/s per host) for v4 (4 chips a host)
# and v6e (8); PCIe from the book (1.5e10 bytes/s per chip, v6e's 32 GB/s about twice that).
CHIPS: dict[str, TpuChip] = {
    "v4": TpuChip(
        "v4", "TPU v4", 275e12, 32 * GiB, 1200e9, 45e9, 3, 25e9 / 4, 15e9, 2, 4096,
        f"{_CLOUD}v4; {_BOOK}",
    ),
    "v5p": TpuChip(
        "v5p", "TPU v5", 459e12, 95 * GiB, 2765e9, 100e9, 3, 50e9 / 8, 15e9, 2, 6144,
        f"{_CLOUD}v5p; {_BOOK}",
    ),
    "v5e": TpuChip(
        "v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9, 50e9, 2, 200e9 / 8 / 8, 15e9, 1, 256,
        f"{_CLOUD}v5e; {_BOOK}",
    ),
    "v6e": TpuChip(
        "v6e", "TPU v6 lite", 918e12, 32 * GiB, 1638e9, 100e9, 2, 25e9 / 8, 32e9, 1, 256,
        f"{_CLOUD}v6e; {_BOOK}",
    ),
}  # fmt: skip
# Other spellings of the generations, as the cloud and JAX write them.
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5": "v5p", "v6": "v6e", "trillium": "v6e"}
# Layouts of the slices below a full cube (v4, v5p) or of every slice (v5e, v6e), by chips.
_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16)}
_2D[256] = (16, 16)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """`slices` identical TPU slices of `shape` chips, joined over the data-center network."""

    chip: TpuChip
    shape: tuple[int, ...]
    slices: int = 1

    @property
    def chips(self) -> int:
        """Chips in all the slices together."""
        return math.prod(self.shape) * self.slices

    @property
    def jax_name(self) -> str:
        """The topology name `jax.experimental.topologies.get_topology_desc` takes."""
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def cloud_name(self) -> str:
        """The accelerator type Google Cloud names one of these slices."""
        return f"{self.chip.name}-{math.prod(self.shape) * self.chip.cores_per_chip}"

    @property
    def wrap(self) -> tuple[bool, ...]:
        """Which dimensions close into rings (torus links): full cubes of v4/v5p (multiples
        of 4 from 4x4x4 up), and 16-chip sides of v5e/v6e."""
        if self.chip.torus_dims == 3:
            cube = math.prod(self.shape) >= 64
            return tuple(cube and n % 4 == 0 for n in self.shape)
        return tuple(n == 16 for n in self.shape)

    def describe(self) -> str:
        many = f"{self.slices} x " if self.slices > 1 else ""
        return f"{many}{self.cloud_name} ({self.jax_name}, {self.chips} chips)"


def parse_slice(name: str, slices: int = 1) -> TpuSlice:
    """The slice a cloud name (`v5p-128`, `v5e-256`, `v5litepod-16`, `v6e-64`, `v4-8`) or a JAX
    name (`v5p:4x4x4`, `v5e:2x2`) describes; a TopologyError for anything else."""
    if slices < 1:
        raise TopologyError(f"--slices {slices}: give 1 or more slices")
    text = name.strip().lower()
    jax_form = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
    cloud_form = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    generation = (jax_form or cloud_form).group(1) if (jax_form or cloud_form) else ""
    chip = CHIPS.get(_ALIASES.get(generation, generation))
    if chip is None:
        raise TopologyError(
            f"unknown TPU topology {name!r}; write a cloud name such as v5p-128, v5e-256, "
            f"v6e-64 or v4-32 (generations: {', '.join(CHIPS)}), or a JAX name such as v5p:4x4x4"
        )
    if jax_form:
        shape = tuple(int(n) for n in jax_form.group(2).split("x"))
        if len(shape) != chip.torus_dims or math.prod(shape) not in _chip_counts(chip):
            raise TopologyError(
                f"topology {name!r}: {chip.name} slices are {chip.torus_dims}-D layouts of "
                f"{_counts_text(chip)} chips; e.g. {_example(chip)}"
            )
        expected = _layout(chip, math.prod(shape))
        if chip.torus_dims == 2 and sorted(shape) != sorted(expected):
            raise TopologyError(
                f"topology {name!r}: a {math.prod(shape)}-chip {chip.name} slice is "
                f"{chip.name}:{'x'.join(map(str, expected))}"
            )
        return TpuSlice(chip, shape, slices)
    count = int(cloud_form.group(2))
    if count % chip.cores_per_chip or count // chip.cores_per_chip not in _chip_counts(chip):
        unit = "TensorCores (two per chip)" if chip.cores_per_chip == 2 else "chips"
        raise TopologyError(
            f"topology {name!r}: {chip.name} names count {unit}; a slice has "
            f"{_counts_text(chip, chip.cores_per_chip)} of them, e.g. {_example(chip)}"
        )
    return TpuSlice(chip, _layout(chip, count // chip.cores_per_chip), slices)


def _chip_counts(chip: TpuChip) -> set[int] | range:
    if chip.torus_dims == 2:
        return set(_2D)
    return set(_SMALL_3D) | set(range(64, chip.max_chips + 1, 64))


def _counts_text(chip: TpuChip, per: int = 1) -> str:
    if chip.torus_dims == 2:
        return ", ".join(str(n * per) for n in _2D)
    small = ", ".join(str(n * per) for n in _SMALL_3D)
    return f"{small} or a multiple of {64 * per} up to {chip.max_chips * per}"


def _example(chip: TpuChip) -> str:
    return f"{chip.name}-{(64 if chip.torus_dims == 3 else 16) * chip.cores_per_chip}"


def _layout(chip: TpuChip, chips: int) -> tuple[int, ...]:
    """The chips' grid: the listed small layouts, else (v4/v5p from one 4x4x4 cube up) the most
    nearly cubic sides that are multiples of 4, smallest first, as the cloud shapes them
    (v5p-768 is 4x8x12, v5p-1536 8x8x12)."""
    if chip.torus_dims == 2:
        return _2D[chips]
    if chips in _SMALL_3D:
        return _SMALL_3D[chips]
    cubes = chips // 64
    best = min(
        (
            (a, b, cubes // (a * b))
            for a, b in itertools.product(range(1, cubes + 1), repeat=2)
            if a <= b and cubes % (a * b) == 0 and b <= cubes // (a * b)
        ),
        key=lambda s: (s[2] / s[0], s),
    )
    return tuple(4 * n for n in best)
