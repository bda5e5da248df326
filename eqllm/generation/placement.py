"""The engine on a device mesh: weights and KV cache split over `tensor`, slots over `data`.

The weights take the training rules (`eqllm.sharding.RULES`): attention heads, kv heads and MLP
hidden units split over the `tensor` axis (Megatron's column- then row-parallel halves, one
all-reduce each), the vocabulary too where it divides. Each slot's KV cache is split like the kv
heads, so a device holds 1/tensor of every layer's weights and cache; the slots (the decode
batch) are split over `data`, each data replica decoding its share. XLA's SPMD partitioner adds
the collectives; the model code is the single-device code. Stacked LoRA adapters are split as
their base weights are (`eqllm.generation.adapters.shardings`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqllm.config import ModelConfig
from eqllm.config.kinds import layer_stacks
from eqllm.generation import adapters
from eqllm.generation.recurrent import is_state
from eqllm.sharding import MeshConfig, MeshError, check_divisible, make_mesh, param_shardings


def serving_mesh(text: str, devices: list | None = None) -> Mesh:
    """The mesh `--mesh` asks for ('tensor=4', 'data=2,tensor=4'), over the first devices it
    needs (all of them when an axis is -1). Serving splits over `data` and `tensor` only."""
    config = MeshConfig.parse(text)
    if config.pipeline != 1 or config.fsdp != 1:
        raise MeshError(
            f"--mesh {config.describe()}: serving splits over tensor and data only; "
            "set pipeline and fsdp to 1 (e.g. --mesh tensor=4 or data=2,tensor=4)"
        )
    devices = jax.devices() if devices is None else devices
    sizes = config.sizes()
    if -1 not in sizes:
        wanted = math.prod(sizes)
        if wanted > len(devices):
            raise MeshError(
                f"--mesh {config.describe()} needs {wanted} devices but {len(devices)} are "
                "available; choose sizes whose product is at most the device count"
            )
        devices = devices[:wanted]
    return make_mesh(config, devices)


def check_mesh(config: ModelConfig, mesh: Mesh, max_batch: int) -> None:
    """Refuse a mesh that splits a head or an MLP unit, or the slots unevenly."""
    if mesh.shape["pipeline"] != 1 or mesh.shape["fsdp"] != 1:
        raise MeshError(
            f"mesh {dict(mesh.shape)}: serving splits over tensor and data only; set pipeline "
            "and fsdp to 1"
        )
    check_divisible(config, mesh)
    data = mesh.shape["data"]
    if max_batch % data:
        raise MeshError(
            f"data={data} does not divide max_batch={max_batch}: each data replica decodes an "
            f"equal share of the slots; choose a max_batch that is a multiple of {data}"
        )


def place_weights(model, layers: tuple, mesh: Mesh):
    """The sliced `layers` (`CausalLM.layers()`) and `model` without its stacked blocks, placed by
    the rules; a layer's arrays are split as the stacked ones are, less the `layers` axis."""
    shardings = adapters.shardings(model, param_shardings(model, mesh))  # LoRA: like the base

    def sliced(stack):  # one layer's shardings: the stack's, less the `layers` axis
        return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])), stack)

    order = layer_stacks(model.config)  # each layer's stack, as layers() orders them
    per_layer = [sliced(getattr(shardings, field)) for field in order]
    layers = tuple(
        jax.tree.map(jax.device_put, layer, where)
        for layer, where in zip(layers, per_layer, strict=True)
    )
    model, shardings = model.without_stacks(), shardings.without_stacks()
    return jax.tree.map(jax.device_put, model, shardings), layers


def state_shardings(state, mesh: Mesh):
    """Shardings for a `SlotState`: the per-slot arrays split over `data` by slot; each pool's
    token rows over `data` too, and keys and values (rows, kv_heads, head_dim) also over
    `tensor` by kv head (latents, without a head axis, over `data` only)."""
    by_row = NamedSharding(mesh, PartitionSpec("data"))
    by_head = NamedSharding(mesh, PartitionSpec("data", "tensor"))

    def entry(c):  # recurrent states by slot alone; a pair (pool, state) part by part
        if isinstance(c, tuple):
            return tuple(entry(part) for part in c)
        if is_state(c):
            return jax.tree.map(lambda a: by_row, c)
        return jax.tree.map(lambda a: by_head if a.ndim == 3 else by_row, c)

    cache = tuple(entry(c) for c in state.cache)
    rest = jax.tree.map(lambda a: by_row, eqx.tree_at(lambda s: s.cache, state, ()))
    return eqx.tree_at(lambda s: s.cache, rest, cache)
