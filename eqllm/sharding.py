"""Data, FSDP and tensor parallelism as shardings over a `jax.sharding.Mesh`.

The mesh has three named axes: `data` (batch split, parameters replicated), `fsdp` (batch split
and parameters/optimizer state split, ZeRO-3 style) and `tensor` (attention heads and MLP hidden
units split, Megatron style: q/k/v/up/gate are column-parallel, o/down row-parallel, so each
block half ends in one all-reduce). Every parameter gets its sharding from the logical names of
its axes (`PARAM_AXES`) and one rule table (`RULES`); no model code knows about devices. XLA's
SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqllm.config import ModelConfig
from eqllm.errors import EqllmError
from eqllm.model import CausalLM

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes it is split over (None: replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "layers": None,
    "vocab": "tensor",
    "d_model": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "d_ff": "tensor",
}

# Parameter path (as in `model.blocks.attn.q_proj.weight`) -> logical names of its axes.
# eqx.nn.Linear stores weights as (out, in); stacked blocks have a leading `layers` axis.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed.weight": ("vocab", "d_model"),
    "pos_embed.weight": (None, "d_model"),
    "lm_head.weight": ("vocab", "d_model"),
    "final_norm.weight": (None,),
    "final_norm.bias": (None,),
    "blocks.attn_norm.weight": ("layers", None),
    "blocks.attn_norm.bias": ("layers", None),
    "blocks.mlp_norm.weight": ("layers", None),
    "blocks.mlp_norm.bias": ("layers", None),
    "blocks.attn.q_proj.weight": ("layers", "heads", "d_model"),
    "blocks.attn.q_proj.bias": ("layers", "heads"),
    "blocks.attn.k_proj.weight": ("layers", "kv_heads", "d_model"),
    "blocks.attn.k_proj.bias": ("layers", "kv_heads"),
    "blocks.attn.v_proj.weight": ("layers", "kv_heads", "d_model"),
    "blocks.attn.v_proj.bias": ("layers", "kv_heads"),
    "blocks.attn.o_proj.weight": ("layers", "d_model", "heads"),
    "blocks.attn.o_proj.bias": ("layers", None),
    "blocks.attn.q_norm.weight": ("layers", None),
    "blocks.attn.k_norm.weight": ("layers", None),
    "blocks.mlp.up.weight": ("layers", "d_ff", "d_model"),
    "blocks.mlp.up.bias": ("layers", "d_ff"),
    "blocks.mlp.gate.weight": ("layers", "d_ff", "d_model"),
    "blocks.mlp.gate.bias": ("layers", "d_ff"),
    "blocks.mlp.down.weight": ("layers", "d_model", "d_ff"),
    "blocks.mlp.down.bias": ("layers", None),
}


class MeshError(EqllmError):
    """A mesh that does not fit the devices or the model; the message says what to change."""


@typing.no_type_check  # validates itself, naming the axis
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the `data`, `fsdp` and `tensor` axes; one of them may be -1 (all the rest)."""

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

    def sizes(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(MESH_AXES, self.sizes(), strict=True))

    def resolve(self, n_devices: int) -> tuple[int, int, int]:
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
                "available; make data*fsdp*tensor equal the device count (or set one axis to -1)"
            )
        return tuple(sizes)

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """'data=2,fsdp=2,tensor=2' -> MeshConfig."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.lstrip("-").isdigit():
                raise MeshError(
                    f"bad mesh item {part!r}; write e.g. 'data=2,fsdp=2,tensor=2' with axes "
                    f"{list(MESH_AXES)}"
                )
            values[name] = int(value)
        if "data" not in values:
            values["data"] = 1 if values else -1
        return cls(**values)


def make_mesh(mesh: MeshConfig, devices: list | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, tensor) over `devices` (default: all of them)."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def logical_axes(model) -> dict[str, tuple[str | None, ...]]:
    """Path -> logical axis names for every array of `model` (arrays or ShapeDtypeStructs)."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    named = {}
    for path, leaf in leaves:
        if not hasattr(leaf, "shape"):
            continue
        name = _path_name(path)
        if name not in PARAM_AXES:
            raise KeyError(f"no sharding rule for parameter {name!r}; add it to PARAM_AXES")
        if len(PARAM_AXES[name]) != len(leaf.shape):
            raise ValueError(f"{name} has shape {leaf.shape}, rule {PARAM_AXES[name]}")
        named[name] = PARAM_AXES[name]
    return named


AxisSizes = Mesh | dict[str, int]


def check_divisible(config: ModelConfig, mesh: AxisSizes) -> None:
    """Refuse meshes whose tensor axis splits a head, or whose fsdp axis splits d_model unevenly."""
    tensor, fsdp = _sizes(mesh)["tensor"], _sizes(mesh)["fsdp"]
    for name, size in (
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.n_kv_heads),
        ("d_ff", config.d_ff),
    ):
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


def _sizes(mesh: AxisSizes) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else mesh


def spec_for(
    axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: AxisSizes
) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes under RULES.

    A dimension that the mesh axes do not divide evenly (GPT-2's vocabulary of 50257, say) is
    left replicated rather than padded.
    """
    parts = []
    for axis, size in zip(axes, shape, strict=True):
        mesh_axes = RULES.get(axis) if axis is not None else None
        if mesh_axes is None:
            parts.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        split = math.prod(_sizes(mesh)[a] for a in mesh_axes)
        parts.append(mesh_axes if size % split == 0 and split > 1 else None)
    while parts and parts[-1] is None:  # P(None, None) and P() are the same placement;
        parts.pop()  # XLA returns the short form, so use it to keep jit's cache keys equal
    return PartitionSpec(*parts)


def param_shardings(model, mesh: Mesh):
    """A pytree like `model` with a NamedSharding at every array (None elsewhere)."""
    check_divisible(model.config, mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    out = []
    for path, leaf in leaves:
        if hasattr(leaf, "shape"):
            axes = PARAM_AXES[_path_name(path)]
            out.append(NamedSharding(mesh, spec_for(axes, leaf.shape, mesh)))
        else:
            out.append(None)
    return jax.tree_util.tree_unflatten(treedef, out)


def shardings_like_params(tree, params, shardings):
    """Shardings for a tree holding copies of the parameters (an optimizer state).

    Every subtree shaped like `params` (AdamW's moments, say) gets the parameters' `shardings`;
    any other array (step counts) is replicated.
    """
    params_def = jax.tree.structure(params)
    mesh = next(s.mesh for s in jax.tree.leaves(shardings))
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_params(node) -> bool:
        return node is not None and jax.tree.structure(node) == params_def

    return jax.tree.map(
        lambda node: shardings if like_params(node) else replicated, tree, is_leaf=like_params
    )


def shard_model(model, mesh: Mesh):
    """Place every array of `model` according to the rules."""
    shardings = param_shardings(model, mesh)
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s) if s is not None else x,
        model,
        shardings,
        is_leaf=lambda x: x is None,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches (batch, seq) split over data and fsdp."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"], None))


def per_device_bytes(model_shapes, mesh: AxisSizes) -> int:
    """Bytes of `model_shapes` (arrays or ShapeDtypeStructs) held by one device.

    `mesh` may be a Mesh or just its axis sizes ({"data": 1, "fsdp": 8, "tensor": 1}), so a
    notional cluster can be sized from a laptop.
    """
    check_divisible(model_shapes.config, mesh)
    sizes = _sizes(mesh)
    total = 0
    for name, axes in logical_axes(model_shapes).items():
        leaf = _leaf_at(model_shapes, name)
        spec = spec_for(axes, leaf.shape, sizes)
        total += math.prod(_shard_shape(leaf.shape, spec, sizes)) * np.dtype(leaf.dtype).itemsize
    return total


def _shard_shape(shape, spec: PartitionSpec, sizes: dict[str, int]) -> list[int]:
    """The shape of one device's piece (a spec may omit trailing replicated dimensions)."""
    parts = tuple(spec) + (None,) * (len(shape) - len(spec))
    return [dim // _split(part, sizes) for dim, part in zip(shape, parts, strict=True)]


def _split(part: str | tuple[str, ...] | None, sizes: dict[str, int]) -> int:
    """How many ways one PartitionSpec entry splits its dimension."""
    if part is None:
        return 1
    return math.prod(sizes[a] for a in ((part,) if isinstance(part, str) else part))


def _leaf_at(model, name: str):
    node = model
    for part in name.split("."):
        node = getattr(node, part)
    return node


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one training configuration (see `estimate_memory`)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def estimate_memory(
    config: ModelConfig,
    mesh: AxisSizes,
    *,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    optimizer_states: int = 2,
) -> MemoryEstimate:
    """Per-device memory of a training step, from shapes alone (nothing is allocated).

    Parameters, gradients and `optimizer_states` fp32 moments (AdamW: 2) follow the sharding
    rules. Activations follow Korthikanti et al. (2022), eq. 2 and its tensor-parallel form,
    per layer and micro-batch: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes at 16 bits, scaled to the
    compute dtype's width, plus the fp32 logits and their gradient; with remat only each layer's
    input (2*s*b*h at 16 bits) is kept, plus one layer's working set. It is an estimate: XLA may
    fuse or keep more.
    """
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    params = per_device_bytes(shapes, mesh)
    opt = optimizer_states * per_device_bytes(_as_fp32(shapes), mesh)
    sizes = _sizes(mesh)
    t = sizes["tensor"]
    batch_split = sizes["data"] * sizes["fsdp"]
    micro = max(1, batch_size // (grad_accum * batch_split))
    s, b, h, a = seq_len, micro, config.d_model, config.n_heads
    width = np.dtype(jax.numpy.dtype(config.compute_dtype)).itemsize / 2
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * width
    if config.remat == "none":
        layers = config.n_layers * per_layer
    else:
        layers = config.n_layers * 2 * s * b * h * width + per_layer
    logits = 2 * s * b * config.vocab_size * 4 / (t if config.vocab_size % t == 0 else 1)
    return MemoryEstimate(params, params, opt, int(layers + logits))


def _as_fp32(shapes):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, np.float32) if hasattr(x, "shape") else x,
        shapes,
    )


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Memory one device can hold: the accelerator's limit, or the host's RAM on CPU."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def check_fits(estimate: MemoryEstimate, device: jax.Device | None = None) -> None:
    """Raise MeshError when the estimate exceeds what one device holds, saying what to change."""
    capacity = device_memory_bytes(device)
    if capacity is not None and estimate.total > capacity:
        gib = 2**30
        raise MeshError(
            f"this run needs about {estimate.total / gib:.1f} GiB per device (params "
            f"{estimate.params / gib:.1f}, grads {estimate.grads / gib:.1f}, optimizer "
            f"{estimate.optimizer / gib:.1f}, activations {estimate.activations / gib:.1f}) but a "
            f"device holds {capacity / gib:.1f} GiB; shard over more devices (fsdp), turn on "
            "remat, or lower the batch size / raise grad_accum"
        )


def sharding_table(config: ModelConfig, mesh: AxisSizes) -> list[str]:
    """Lines describing each parameter's logical axes, PartitionSpec and per-device size."""
    sizes = _sizes(mesh)
    check_divisible(config, sizes)
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    rows = [("parameter", "shape", "logical axes", "spec", "per device")]
    for name, axes in logical_axes(shapes).items():
        leaf = _leaf_at(shapes, name)
        spec = spec_for(axes, leaf.shape, sizes)
        shard = _shard_shape(leaf.shape, spec, sizes)
        rows.append(
            (
                name,
                str(tuple(leaf.shape)),
                str(axes),
                str(tuple(spec)),
                _human_bytes(math.prod(shard) * np.dtype(leaf.dtype).itemsize),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    total = per_device_bytes(shapes, sizes)
    lines.append(
        f"parameters per device: {_human_bytes(total)}; with fp32 AdamW moments and "
        f"gradients: {_human_bytes(4 * total)}"
    )
    return lines


def _human_bytes(n: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        size = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
