"""The devices a plan compiles for: a named TPU slice, or the TPUs attached to this host.

A named slice needs no TPU: libtpu describes its devices (`get_topology_desc`) and its compiler
compiles for them from shapes alone, as MaxText's train_compile.py does. Nothing here opens a
TPU that is not attached; on a TPU VM the attached slice is the default.
"""

from __future__ import annotations

import jax
import numpy as np

from eqllm.errors import EqllmError
from eqllm.sharding.tpu import CHIPS, TpuSlice, parse_slice
from eqllm.tpu_runtime import libtpu_installed, quiet_tpu_probe, tpu_attached


class PlanError(EqllmError):
    """A plan that cannot be made as asked; the message says what to change."""


def install_command() -> str:
    """The pip command that brings the TPU compiler matched to the installed jax."""
    return f'pip install "jax[tpu]=={jax.__version__}"'


def require_libtpu() -> None:
    if not libtpu_installed():
        raise PlanError(
            "eqllm plan compiles with the TPU compiler (libtpu), which is not installed; install "
            f'it with: {install_command()} (or pip install "eqllm[tpu]")'
        )


def slice_devices(tpu: TpuSlice) -> list:
    """The compile-only devices of `tpu` (every chip of every slice, slice by slice)."""
    require_libtpu()
    quiet_tpu_probe()  # before libtpu loads, where no TPU is attached (eqllm.tpu_runtime)
    from jax.experimental.topologies import get_topology_desc

    options: dict = {"wrap": (*tpu.wrap, False, False)[:3]}
    if tpu.chip.cores_per_chip == 2:
        options["chip_config_name"] = "megacore"  # one device per chip, as the cloud runs them
    if np.prod(tpu.shape) == 1:
        options["chips_per_host_bounds"] = (1, 1, 1)
    if tpu.slices > 1:
        options["num_slices"] = tpu.slices
    try:
        return list(
            get_topology_desc(platform="tpu", topology_name=tpu.jax_name, **options).devices
        )
    except jax.errors.JaxRuntimeError as e:
        raise PlanError(f"libtpu does not describe {tpu.describe()}: {e}") from None


def attached_slice() -> tuple[TpuSlice, list] | None:
    """(the slice, its devices) of the TPUs attached to this host; None without any."""
    if not libtpu_installed() or not tpu_attached():
        return None
    devices = jax.devices("tpu")
    chip = next((c for c in CHIPS.values() if c.device_kind == devices[0].device_kind), None)
    if chip is None:
        raise PlanError(
            f"attached TPU {devices[0].device_kind!r} has no figures in "
            "eqllm.sharding.tpu.CHIPS; name a slice with --topology"
        )
    coords = np.array([d.coords for d in devices])
    shape = tuple(int(n) for n in coords.max(0) + 1)[: chip.torus_dims]
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    return parse_slice(f"{chip.name}:{'x'.join(map(str, shape))}", slices), devices
