"""The device mesh: named axes `pipeline`, `data`, `fsdp` and `tensor`, sized from a recipe or a
flag."""

from __future__ import annotations

import dataclasses
import math
import typing

import jax
import numpy as np
from jax.sharding import Mesh

from eqllm.errors import EqllmError

# `pipeline` first: stages exchange only one activation per microbatch, so they may sit furthest
# apart (across hosts); `tensor` last, on the closest devices.
MESH_AXES = ("pipeline", "data", "fsdp", "tensor")


class MeshError(EqllmError):
    """A mesh that does not fit the devices or the model; the message says what to change."""


@typing.no_type_check  # validates itself, naming the axis
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the `pipeline`, `data`, `fsdp` and `tensor` axes; one may be -1 (all the rest)."""

    pipeline: int = 1
    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in zip(MESH_AXES, sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise MeshError(f"mesh.{name}={size!r} must be a positive integer or -1")
        if sizes.count(-1) > 1:
            raise MeshError(f"mesh {self.describe()}: at most one axis may be -1")

    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pipeline, self.data, self.fsdp, self.tensor)

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(MESH_AXES, self.sizes(), strict=True))

    def resolve(self, n_devices: int) -> tuple[int, int, int, int]:
        """Concrete axis sizes for `n_devices`, or a MeshError saying why they do not fit."""
        sizes = list(self.sizes())
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise MeshError(
                    f"mesh {self.describe()}: the fixed axes multiply to {known}, which does not "
                    f"divide the {n_devices} devices; choose sizes whose product divides it"
                )
            sizes[sizes.index(-1)] = n_devices // known
        if math.prod(sizes) != n_devices:
            raise MeshError(
                f"mesh {self.describe()} needs {math.prod(sizes)} devices but {n_devices} are "
                "available; make pipeline*data*fsdp*tensor equal the device count (or set one "
                "axis to -1)"
            )
        return tuple(sizes)

    def axis_sizes(self, n_devices: int | None = None) -> dict[str, int]:
        """{axis: size}: resolved for `n_devices` (`resolve`), or as written (None)."""
        sizes = self.sizes() if n_devices is None else self.resolve(n_devices)
        return dict(zip(MESH_AXES, sizes, strict=True))

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """'pipeline=2,data=2,fsdp=2' -> MeshConfig (data defaults to -1 alone, else 1)."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.lstrip("-").isdigit():
                raise MeshError(
                    f"bad mesh item {part!r}; write e.g. 'pipeline=2,data=2,fsdp=2' with axes "
                    f"{list(MESH_AXES)}"
                )
            values[name] = int(value)
        if "data" not in values:
            values["data"] = 1 if values else -1
        return cls(**values)


def make_mesh(mesh: MeshConfig, devices: list | None = None) -> Mesh:
    """A Mesh with axes (pipeline, data, fsdp, tensor) over `devices` (default: all of them)."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)
