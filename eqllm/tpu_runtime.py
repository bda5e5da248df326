"""libtpu on a machine without a TPU: a quiet start, and the compiler for slices not attached.

With libtpu installed (`pip install "eqllm[tpu]"`, for `eqllm plan`), JAX tries its TPU backend
first whenever it starts. On a machine with no TPU that attempt fails and JAX falls back to the
CPU (or GPU), but libtpu first prints warnings and an initialisation error to stderr, because it
cannot find the accelerator type and host names a TPU VM's metadata server would give it.
`quiet_tpu_probe` gives libtpu those settings when no TPU chip is attached to this host, so the
attempt fails silently; on a TPU VM it changes nothing. It must run before JAX starts a backend:
the `eqllm` command calls it through `eqllm.configure_process()`.
"""

from __future__ import annotations

import importlib.util
import os

# What libtpu reads instead of asking the metadata server of a TPU VM; any valid accelerator
# type does, since no chip will be opened (compiling for a slice names its own topology). With
# no chip to share, several processes may load libtpu at once (it otherwise takes a lock file,
# /tmp/libtpu_lockfile, and a second process fails to start).
_NO_TPU_SETTINGS = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def libtpu_installed() -> bool:
    """Whether the TPU compiler and runtime (the `libtpu` package) can be imported."""
    return importlib.util.find_spec("libtpu") is not None


def tpu_attached() -> bool:
    """Whether this host has TPU chips on its PCI bus (JAX's own check; no backend started)."""
    from jax._src import hardware_utils  # the check JAX runs before its TPU backend

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


def quiet_tpu_probe() -> bool:
    """With libtpu installed and no TPU attached, set libtpu's settings (where unset) so that
    JAX's attempt at a TPU backend fails without printing; returns whether it set them."""
    if not libtpu_installed() or tpu_attached():
        return False
    for key, value in _NO_TPU_SETTINGS.items():
        os.environ.setdefault(key, value)
    return True
