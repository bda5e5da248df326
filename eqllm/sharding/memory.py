"""Per-device memory of a model and a training step, from shapes alone."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec

from eqllm.config import ModelConfig
from eqllm.config.kinds import layer_kinds
from eqllm.model import CausalLM
from eqllm.nn.dispatch import slot_rows
from eqllm.sharding.dispatch import experts_impl
from eqllm.sharding.mesh import MeshError
from eqllm.sharding.rules import (
    RULES,
    AxisSizes,
    check_divisible,
    check_mesh,
    named_params,
    sizes_of,
    spec_for,
)


def per_device_bytes(model_shapes, mesh: AxisSizes) -> int:
    """Bytes of `model_shapes` (arrays or ShapeDtypeStructs) held by one device.

    `mesh` may be a Mesh or just its axis sizes ({"data": 1, "fsdp": 8, "tensor": 1}; an axis
    left out is 1), so a notional cluster can be sized from a laptop. `model_shapes` is a
    `CausalLM` or any tree of eqllm layers.
    """
    check_mesh(model_shapes, mesh)
    sizes = sizes_of(mesh)
    total = 0
    for _, leaf, axes in named_params(model_shapes):
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
    microbatches: int = 1,
    optimizer_states: int = 2,
    backend: str | None = None,
) -> MemoryEstimate:
    """Per-device memory of a training step, from shapes alone (nothing is allocated).

    Parameters, gradients and `optimizer_states` fp32 moments (AdamW: 2) follow the sharding
    rules. Activations follow Korthikanti et al. (2022), eq. 2 and its tensor-parallel form,
    per layer and micro-batch: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes at 16 bits, scaled to the
    compute dtype's width, plus the fp32 logits and their gradient; with remat each layer keeps
    what its policy saves (`_kept`: its input under "full"; none of a mixture of experts'
    grouped matmuls, `_mlp_kept`), plus one layer's working set. A
    pipeline stage counts its own layers, scaled by the bubble's idle ticks (see the comment
    below). A mixture of experts computed by token dispatch on `backend` (default: this
    process's; `moe.impl` "auto" chosen as a run there would) adds its exchange buffers
    (`_dispatch_bytes`). It is an estimate: XLA may fuse or keep more.
    """
    params, fp32 = _parameter_bytes(config.replace(remat="none"), tuple(sizes_of(mesh).items()))
    opt = optimizer_states * fp32
    sizes = sizes_of(mesh)
    t = sizes["tensor"]
    batch_split = sizes["data"] * sizes["fsdp"]
    micro = max(1, batch_size // (grad_accum * batch_split))
    s, b, h, a = seq_len, micro, config.d_model, config.attention.n_heads
    width = np.dtype(jax.numpy.dtype(config.compute_dtype)).itemsize / 2
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * width
    # A pipeline stage keeps its own layers' activations for every tick until the backward pass
    # (GPipe): n_layers / stages layers of the whole batch, times (M + S - 1) / M because the
    # stages also compute (and keep) on their idle ticks (eqllm.train.pipeline).
    stages = sizes["pipeline"]
    n_layers = config.n_layers / stages * (microbatches + stages - 1) / microbatches
    choice = experts_impl(config, backend or jax.default_backend(), sizes)
    impl = choice and choice[0]
    n_moe = sum(kind != "dense" for kind in layer_kinds(config)) if impl else 0
    if config.remat == "none":
        layers = n_layers * per_layer
    else:
        kept = n_moe * _kept(config, s, b, t, impl) + (config.n_layers - n_moe) * _kept(
            config, s, b, t
        )
        layers = n_layers * kept / config.n_layers * width + per_layer
    logits = 2 * s * b * config.vocab_size * 4 / (t if config.vocab_size % t == 0 else 1)
    # One dispatched layer's buffers hold one pipeline microbatch's rows; without remat each
    # expert layer of a stage keeps them for every tick, with it one layer's are live.
    buffers = _dispatch_bytes(config, sizes, s * b // microbatches, impl)
    ticks = microbatches + stages - 1
    buffers *= 2 if config.remat != "none" else n_moe / stages * ticks + 1
    return MemoryEstimate(params, params, opt, int(layers + logits + buffers * width))


def _dispatch_bytes(
    config: ModelConfig, sizes: dict[str, int], rows: int, impl: str | None
) -> float:
    """Bytes (at 16 bits) of one dispatched expert layer's forward pass on a device holding
    `rows` tokens: the received copies, their outputs and the returned block (each n_shards x
    slot rows of d_model, `eqllm.nn.dispatch.slot_rows`) and the experts' hidden units (gate,
    up, their product; up and its activation without a gate) over the same rows. 0 unless the
    experts are dispatched (`impl`)."""
    moe = config.moe
    shards = sizes[RULES["expert"]]
    if impl != "dispatch" or shards == 1 or moe.n_experts % shards:
        return 0.0
    k, local = moe.experts_per_token, moe.n_experts // shards
    buffer = shards * slot_rows(rows, k, local, shards, moe.capacity_factor)
    d_ff = config.expert_d_ff / (
        sizes["tensor"] if config.expert_d_ff % sizes["tensor"] == 0 else 1
    )
    return 2.0 * buffer * (3 * config.d_model + (3 if moe.gated else 2) * d_ff)


def _kept(config: ModelConfig, s: int, b: int, t: int, experts: str | None = None) -> float:
    """Bytes (at 16 bits) one layer keeps in HBM for the backward pass under its remat policy:
    its input ("full"; "offload" keeps it in the host's memory, `offloaded_bytes`); with it the
    outputs of the unbatched matrix products, q/k/v/o and the MLP's ("dots_no_batch"); with
    those the attention's batched products too, the scores and their weighted sum ("dots").
    `experts`: how a layer with experts computes them (None: a dense MLP), whose products the
    policies keep differently (`_mlp_kept`)."""
    h, a = config.d_model, config.attention.n_heads
    kept = 0 if config.remat == "offload" else 2 * s * b * h
    if config.remat in ("dots", "dots_no_batch"):
        kv = config.attention.n_kv_heads * config.head_dim
        kept += 2 * s * b * (h / t + 2 * kv / t + h + _mlp_kept(config, t, experts))
    if config.remat == "dots":
        kept += 2 * b * a * s * s / t + 2 * s * b * h / t
    return float(kept)


def offloaded_bytes(
    config: ModelConfig, mesh: AxisSizes, *, batch_size: int, seq_len: int
) -> float:
    """Bytes per device remat "offload" moves to the host's memory and back in one step: each
    layer's input of every sequence the device holds (the data and fsdp axes split the batch;
    each tensor-parallel device keeps its own copy; a pipeline stage its own layers), out in
    the forward pass and back in the backward pass, at the compute dtype's width. 0 under any
    other policy."""
    if config.remat != "offload":
        return 0.0
    sizes = sizes_of(mesh)
    rows = batch_size * seq_len / (sizes["data"] * sizes["fsdp"])
    width = np.dtype(jax.numpy.dtype(config.compute_dtype)).itemsize
    return 2.0 * config.n_layers / sizes["pipeline"] * rows * config.d_model * width


def _mlp_kept(config: ModelConfig, t: int, experts: str | None) -> float:
    """Values per token the dots policies keep of a layer's MLP: a dense MLP's gate and up
    outputs and its output. Of a mixture of experts: the router's logits and the shared
    expert's products (unbatched); the grouped matmuls ("ragged", "dispatch") are
    `ragged_dot` or Pallas kernels, which no dots policy saves, so the backward pass recomputes
    them from the layer's input; the dense product's are batched over experts, kept by "dots"
    alone (every expert's hidden units and outputs, and the combined output)."""
    h = config.d_model
    if experts is None:
        return 2 * config.mlp.d_ff / t + h
    moe = config.moe
    projections = 2 if moe.gated else 1  # gate and up, or up alone
    kept = float(moe.n_experts)  # the router's logits
    if moe.shared_d_ff:
        kept += projections * moe.shared_d_ff / t + h
    if config.remat == "dots":
        kept += h  # the k outputs combined with their weights: a batched product
        if experts == "dense":
            kept += moe.n_experts * (projections * config.expert_d_ff / t + h)
    return kept


@functools.lru_cache(maxsize=256)
def _parameter_bytes(config: ModelConfig, sizes: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    """(bytes of the parameters per device, the same in fp32): a search asks for many meshes of
    one model."""
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    return per_device_bytes(shapes, dict(sizes)), per_device_bytes(_as_fp32(shapes), dict(sizes))


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
    sizes = sizes_of(mesh)
    check_divisible(config, sizes)
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    rows = [("parameter", "shape", "logical axes", "spec", "per device")]
    for name, leaf, axes in named_params(shapes):
        spec = spec_for(axes, leaf.shape, sizes)
        shard = _shard_shape(leaf.shape, spec, sizes)
        rows.append(
            (
                name,
                str(tuple(leaf.shape)),
                str(axes),
                str(tuple(spec)),
                human_bytes(math.prod(shard) * np.dtype(leaf.dtype).itemsize),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    total = per_device_bytes(shapes, sizes)
    lines.append(
        f"parameters per device: {human_bytes(total)}; with fp32 AdamW moments and "
        f"gradients: {human_bytes(4 * total)}"
    )
    return lines


def human_bytes(n: int | float) -> str:
    """`n` bytes as "1.50 GiB", "12.00 MiB", "3.00 KiB" or "7 B"."""
    for unit in ("GiB", "MiB", "KiB"):
        size = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
