"""Logical axes -> mesh axes: the one rule table, and the shardings derived from it.

Everything here works on any tree of eqllm layers (`eqllm.nn.param_info`: the logical axes their
weights carry), a researcher's own model as much as `CausalLM`. What only a `CausalLM` adds: its
stacked blocks' leading axis is named `layers` (split into pipeline stages), and a mesh is
checked against its config's sizes, named as a recipe names them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqllm.config import ModelConfig
from eqllm.config.kinds import STACKS, pipeline_layers
from eqllm.model import CausalLM
from eqllm.nn import Attention, MultiHeadLatentAttention, param_info
from eqllm.nn.params import is_param_info
from eqllm.sharding.mesh import MESH_AXES, MeshError

# Logical axis -> mesh axes it is split over (None or absent: replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "d_model": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "d_ff": "tensor",
    # The stacked blocks' leading axis: contiguous runs of layers, one per pipeline stage.
    "layers": "pipeline",
    # Experts spread over the fsdp devices (expert parallelism on the fsdp axis); the expert
    # weights' d_model axis, also fsdp, is then left whole (see spec_for).
    "expert": "fsdp",
}


def model_param_info(model):
    """`eqllm.nn.param_info` with the leading axis of every stacked-block array named `layers`.

    The layers know their own axes but not that `CausalLM` stacks them; the model does.
    """
    infos = param_info(model)
    if not isinstance(model, CausalLM):
        return infos

    def named(info):
        return dataclasses.replace(info, axes=("layers", *info.axes[1:]))

    for name in STACKS.values():  # every stack of layers
        stack = getattr(infos, name)
        if stack is not None:
            stack = jax.tree.map(named, stack, is_leaf=is_param_info)
            infos = eqx.tree_at(lambda m, n=name: getattr(m, n), infos, stack)
    return infos


def named_params(model) -> list[tuple[str, Any, tuple[str | None, ...]]]:
    """(path, array, logical axes) for every array of `model` (arrays or ShapeDtypeStructs).

    The axes come from the layers themselves (`eqllm.nn.param_info`); the path reads like
    `blocks.attn.q_proj.weight` (whose axes are ("layers", "heads", "d_model")).
    """
    infos, treedef = jax.tree.flatten(model_param_info(model), is_leaf=is_param_info)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    arrays = treedef.flatten_up_to(model)
    return [
        (jax.tree_util.keystr(path, simple=True, separator="."), array, info.axes)
        for path, array, info in zip(paths, arrays, infos, strict=True)
    ]


def logical_axes(model) -> dict[str, tuple[str | None, ...]]:
    """Path -> logical axis names for every array of `model` (see `named_params`)."""
    return {name: axes for name, _, axes in named_params(model)}


AxisSizes = Mesh | dict[str, int]


def check_divisible(config: ModelConfig, mesh: AxisSizes) -> None:
    """Refuse meshes whose tensor axis splits a head, whose fsdp axis splits d_model unevenly or
    whose pipeline axis splits the layers into unequal stages."""
    tensor, fsdp = sizes_of(mesh)["tensor"], sizes_of(mesh)["fsdp"]
    stages = sizes_of(mesh)["pipeline"]
    prefix, staged = pipeline_layers(config)
    if staged % stages:
        what = f"n_layers={config.n_layers}"
        if prefix:  # DeepSeek's dense prefix runs before the stages
            what = f"the {staged} layers after the {prefix} dense ones (moe.dense_layers)"
        raise MeshError(
            f"pipeline={stages} does not divide {what}: each stage runs an equal, contiguous "
            f"run of layers; choose a pipeline size that divides {staged}"
        )
    sizes = [
        ("attention.n_heads", config.attention.n_heads),
        ("attention.n_kv_heads", config.attention.n_kv_heads),
        ("mlp.d_ff", config.mlp.d_ff),
    ]
    if (lin := config.linear) is not None:  # a stack without attention (or MLP) splits neither
        kept = {"mlp.d_ff"} if lin.mlp else set()
        sizes = [s for s in sizes if not lin.pure or s[0] in kept]
        sizes.append(("linear.n_value_heads", lin.n_value_heads))
    for name, size in sizes:
        if size % tensor:
            raise MeshError(
                f"tensor={tensor} does not divide {name}={size}: tensor parallelism splits whole "
                f"heads and hidden units; choose a tensor size that divides {name}"
            )
    if config.d_model % fsdp:
        raise MeshError(
            f"fsdp={fsdp} does not divide d_model={config.d_model}; choose an fsdp size that "
            "divides it"
        )


def sizes_of(mesh: AxisSizes) -> dict[str, int]:
    """Every mesh axis's size; axes a dict leaves out are 1."""
    return {**dict.fromkeys(MESH_AXES, 1), **(dict(mesh.shape) if isinstance(mesh, Mesh) else mesh)}


def check_mesh(model, mesh: AxisSizes) -> None:
    """Refuse a mesh that would split `model` where it must not: a `CausalLM` by its config's
    sizes (`check_divisible`), any other tree of eqllm layers by the head counts of its
    attention layers (tensor parallelism splits whole heads). Any other dimension that a mesh
    axis does not divide stays whole (`spec_for`)."""
    if isinstance(model, CausalLM):
        check_divisible(model.config, mesh)
        return
    tensor = sizes_of(mesh)["tensor"]

    def is_attention(node) -> bool:
        return isinstance(node, Attention | MultiHeadLatentAttention)

    for path, layer in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_attention)[0]:
        if not is_attention(layer):
            continue
        where = jax.tree_util.keystr(path, simple=True, separator=".")
        counts = {"n_heads": layer.n_heads}
        if isinstance(layer, Attention):
            counts["n_kv_heads"] = layer.n_kv_heads
        for name, size in counts.items():
            if size % tensor:
                raise MeshError(
                    f"tensor={tensor} does not divide {where}.{name}={size}: tensor parallelism "
                    f"splits whole heads; choose a tensor size that divides {size}"
                )


def spec_for(
    axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: AxisSizes
) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes under RULES.

    A dimension that the mesh axes do not divide evenly (GPT-2's vocabulary of 50257, say) is
    left replicated rather than padded. A mesh axis already used by an earlier dimension (fsdp
    by an expert weight's `expert` axis, say) does not split a later one.
    """
    parts = []
    used: set[str] = set()
    for axis, size in zip(axes, shape, strict=True):
        mesh_axes = RULES.get(axis) if axis is not None else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        if mesh_axes is None or used & set(mesh_axes):
            parts.append(None)
            continue
        split = math.prod(sizes_of(mesh)[a] for a in mesh_axes)
        splits = size % split == 0 and split > 1
        parts.append(mesh_axes if splits else None)
        used |= set(mesh_axes) if splits else set()
    while parts and parts[-1] is None:  # P(None, None) and P() are the same placement;
        parts.pop()  # XLA returns the short form, so use it to keep jit's cache keys equal
    return PartitionSpec(*parts)


def param_shardings(model, mesh: Mesh):
    """A pytree like `model` (a `CausalLM` or any tree of eqllm layers) with the NamedSharding
    of every array; a mesh that would split a head is refused (`check_mesh`)."""
    check_mesh(model, mesh)
    return jax.tree.map(
        lambda info, x: NamedSharding(mesh, spec_for(info.axes, x.shape, mesh)),
        model_param_info(model),
        model,
        is_leaf=is_param_info,
    )


def shardings_like_params(tree, params, shardings):
    """Shardings for a tree holding copies of the parameters (an optimizer state).

    Every subtree shaped like `params` (AdamW's moments, say) gets the parameters' `shardings`
    where its arrays have their parameters' shapes; any other array (step counts, Adafactor's
    factored row and column statistics) is replicated. A subtree of one parameter group
    (`optax.multi_transform`: Muon's matrices, muP's roles) is shaped like `params` with an
    empty `optax.MaskedNode` at the other groups' parameters, and is placed the same way.
    """
    params_def = jax.tree.structure(params)
    mesh = next(s.mesh for s in jax.tree.leaves(shardings))
    replicated = NamedSharding(mesh, PartitionSpec())

    def hole(node) -> bool:
        return isinstance(node, optax.MaskedNode)

    def like_params(node) -> bool:
        return node is not None and jax.tree.structure(node, is_leaf=hole) == params_def

    def placed(node):
        if not like_params(node):
            return replicated
        return jax.tree.map(
            lambda x, p, s: x if hole(x) else s if x.shape == p.shape else replicated,
            node,
            params,
            shardings,
            is_leaf=hole,
        )

    return jax.tree.map(placed, tree, is_leaf=like_params)


def shard_model(model, mesh: Mesh):
    """Place every array of `model` (any tree of eqllm layers) according to the rules."""
    return jax.tree.map(jax.device_put, model, param_shardings(model, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches (batch, seq) split over data and fsdp."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"], None))
