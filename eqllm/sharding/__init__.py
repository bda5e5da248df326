"""Data, FSDP, tensor and pipeline parallelism as shardings over a `jax.sharding.Mesh`.

The mesh has four named axes: `pipeline` (the stacked layers split into contiguous stages; the
schedule is `eqllm.train.Pipeline`), `data` (batch split, parameters replicated), `fsdp` (batch
split and parameters/optimizer state split, ZeRO-3 style) and `tensor` (attention heads and MLP
hidden units split, Megatron style: q/k/v/up/gate are column-parallel, o/down row-parallel, so
each block half ends in one all-reduce). Every parameter gets its sharding from the logical names of
its axes, which its layer carries (`eqllm.nn.param_info`), and one rule table (`RULES`); no
model code knows about devices. XLA's SPMD partitioner inserts the collectives. Any tree of
eqllm layers is sharded alike, not only eqllm's own model (docs/modules.md).
"""

from eqllm.sharding.fsdp import FsdpGather, fsdp_gather
from eqllm.sharding.memory import (
    MemoryEstimate,
    check_fits,
    device_memory_bytes,
    estimate_memory,
    per_device_bytes,
    sharding_table,
)
from eqllm.sharding.mesh import MESH_AXES, MeshConfig, MeshError, make_mesh
from eqllm.sharding.rules import (
    RULES,
    batch_sharding,
    check_divisible,
    check_mesh,
    logical_axes,
    param_shardings,
    shard_model,
    shardings_like_params,
    spec_for,
)

__all__ = [
    "FsdpGather",
    "MESH_AXES",
    "RULES",
    "MemoryEstimate",
    "MeshConfig",
    "MeshError",
    "batch_sharding",
    "check_divisible",
    "check_fits",
    "check_mesh",
    "device_memory_bytes",
    "estimate_memory",
    "fsdp_gather",
    "logical_axes",
    "make_mesh",
    "param_shardings",
    "per_device_bytes",
    "shard_model",
    "sharding_table",
    "shardings_like_params",
    "spec_for",
]
