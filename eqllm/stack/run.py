"""Running the stacked blocks in order with `lax.scan`: one stack (`run_blocks`, with its
per-layer flags), a dense prefix then the main stack, or a hybrid's repeating group of layer
kinds (`run_groups`); remat policies and the per-layer hook (`each_layer`) of FSDP."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eqllm.config import ModelConfig
from eqllm.nn import Block, Routing

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Applied to each layer's Block inside the layer loop's body (see `each_layer`): returns what
# runs in the block's place, called as block(x, positions, local, segment_ids, rotate).
LayerHook = Callable[[Block], Callable]
_LAYER_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar(
    "eqllm_layer_hook", default=None
)


@contextlib.contextmanager
def each_layer(hook: LayerHook) -> Iterator[None]:
    """While tracing inside this context, `run_blocks` runs `hook(block)` in place of each
    layer's Block, inside the loop body (scanned or unrolled); the hook's result is called like
    `Block.routed`, `(x, positions, local, segment_ids, rotate) -> (x, routing)`.

    This is how FSDP gathers one layer's weights at a time (`eqllm.sharding.FsdpGather`):
    sharding constraints placed here stay inside the loop, where XLA otherwise gathers every
    layer before it. Without remat, the backward pass keeps every intermediate of the body but
    the outputs of sharding constraints and custom-gradient calls (the gathered weights), and
    recomputes those from the layer's split arrays.
    """
    token = _LAYER_HOOK.set(hook)
    try:
        yield
    finally:
        _LAYER_HOOK.reset(token)


def _save_all_but_gathers(prim, *_, **__) -> bool:
    """A remat policy that keeps every intermediate except the outputs of sharding constraints
    and custom-gradient calls (the gathered weights of `each_layer`): the backward pass gathers
    them again, one layer at a time, rather than keeping every layer's whole weights."""
    return prim.name not in ("sharding_constraint", "custom_vjp_call", "custom_vjp_call_jaxpr")


def run_blocks(
    blocks: Block,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    first: int = 0,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply the stacked blocks in order: `lax.scan` or an unrolled Python loop (see below).

    `positions` None means 0..seq-1 (see `Attention.__call__`); `segment_ids` (None: one
    segment) keep every layer's attention inside each packed document. A model whose layers differ
    (`layer_flags`) scans the flags alongside the weights: one compiled body for every layer.
    `first`: the model's index of the stack's first layer (a mixture of experts after a dense
    prefix). Returns the output and, for a mixture of experts, every layer's `Routing` (router
    logits and dropped copies, stacked on a leading layers axis; else None).
    """
    params, static = eqx.partition(blocks, eqx.is_array)
    n_layers = jax.tree.leaves(params)[0].shape[0]
    local, rotate = (
        None if f is None else f[first : first + n_layers] for f in layer_flags(config)
    )
    xs = (params, _traced(local), _traced(rotate))

    hook = _LAYER_HOOK.get()

    def step(h, layer):
        layer_params, layer_local, layer_rotate = layer
        block = eqx.combine(layer_params, static)
        if hook is not None:
            return hook(block)(h, positions, layer_local, segment_ids, layer_rotate)
        return block.routed(h, positions, layer_local, segment_ids, layer_rotate)

    if config.remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[config.remat])
    elif hook is not None:
        step = jax.checkpoint(step, policy=_save_all_but_gathers)
    # Remat needs the loop: unrolled, XLA computes each block's recomputation as early as its
    # input exists, so the activations live as long as without remat (llama-mini at 2 x 256:
    # 480 MiB unrolled vs 360 MiB scanned, 493 / 449 MiB without remat).
    if config.scan_layers or config.remat != "none":
        return jax.lax.scan(step, x, xs)
    routings = []
    for i in range(n_layers):  # each layer's flags are known here: Python bools
        flags = (layer_flag(local, i), layer_flag(rotate, i))
        x, routing = step(x, (jax.tree.map(lambda a, i=i: a[i], params), *flags))
        routings.append(routing)
    return x, _stacked(routings)


def run_groups(
    stacks: dict[str, Block],
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply a stack whose layers repeat a pattern of kinds (`ModelConfig.layer_kinds`: a
    hybrid's linear-attention and full-attention layers), one stacked Block per kind.

    Each kind's stack is viewed as (groups, layers of that kind per group, ...) and `lax.scan`
    runs over the groups: one compiled body (the group's layers in pattern order) serves any
    depth. Remat, the `each_layer` hook and `scan_layers=False` act per layer as in
    `run_blocks`. Returns the output and every layer's `Routing` in layer order (None
    without experts).
    """
    kinds = config.layer_kinds()
    pattern = kinds[: config.linear.full_every]  # the repeating group
    n_groups = len(kinds) // len(pattern)
    parts = {k: eqx.partition(stack, eqx.is_array) for k, stack in stacks.items()}
    grouped = {
        k: jax.tree.map(lambda a: a.reshape(n_groups, -1, *a.shape[1:]), params)
        for k, (params, _) in parts.items()
    }
    hook = _LAYER_HOOK.get()

    def layer(h, params, kind):
        block = eqx.combine(params, parts[kind][1])
        if hook is not None:
            return hook(block)(h, positions, None, segment_ids, None)
        return block.routed(h, positions, None, segment_ids, None)

    if config.remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat], static_argnums=2)
    elif hook is not None:
        layer = jax.checkpoint(layer, policy=_save_all_but_gathers, static_argnums=2)

    def group(h, params):
        seen = dict.fromkeys(params, 0)
        logits = []
        for kind in pattern:
            h, out = layer(h, jax.tree.map(lambda a, i=seen[kind]: a[i], params[kind]), kind)
            seen[kind] += 1
            logits.append(out)
        return h, _stacked(logits)

    if config.scan_layers or config.remat != "none":
        x, logits = jax.lax.scan(group, x, grouped)
    else:
        outs = []
        for g in range(n_groups):
            x, out = group(x, jax.tree.map(lambda a, g=g: a[g], grouped))
            outs.append(out)
        logits = _stacked(outs)
    # (groups, layers per group, ...) -> (layers, ...), in layer order
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), logits)


def run_stacks(
    dense_blocks: Block | None,
    blocks: Block,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    linear_blocks: Block | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """`run_blocks` over a dense prefix (`moe.dense_layers` layers, None: none) and then the
    main stack: two scanned segments, each one compiled body. The `Routing` is that of the
    main stack's layers. A hybrid (`linear_blocks`, its linear-attention layers) runs its
    groups of layers of both kinds (`run_groups`)."""
    if linear_blocks is not None:
        stacks = {"linear": linear_blocks, "full": blocks}
        return run_groups(stacks, x, positions, config, segment_ids)
    if dense_blocks is not None:
        x, _ = run_blocks(dense_blocks, x, positions, config, segment_ids)
    first = 0 if dense_blocks is None else config.moe.dense_layers
    return run_blocks(blocks, x, positions, config, segment_ids, first)


def _stacked(routings: list[Routing | None]) -> Routing | None:
    """Per-layer `Routing`s stacked on a leading layers axis (None without experts)."""
    if routings[0] is None:
        return None
    return jax.tree.map(lambda *layers: jnp.stack(layers), *routings)


def layer_flags(config: ModelConfig) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The per-layer flags (local, rotate): whether each layer attends through the sliding
    window (`ModelConfig.local_layers`) and whether it rotates queries and keys
    (`ModelConfig.rotary_layers`). Each is None when every layer is alike in it and needs no
    flag: without a local/global pattern, without NoPE layers."""
    local = None if config.attention.global_every is None else np.array(config.local_layers())
    nope = config.positions.kind == "rope" and config.positions.nope_every is not None
    rotate = np.array(config.rotary_layers()) if nope else None
    return local, rotate


def layer_flag(flags: np.ndarray | None, i: int) -> bool | None:
    """Layer i's flag as a Python bool (None for a model without that flag)."""
    return None if flags is None else bool(flags[i])


def _traced(flags: np.ndarray | None):
    return None if flags is None else jnp.asarray(flags)
