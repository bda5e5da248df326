"""Running the stacked blocks in order with `lax.scan`: the layers' kinds cut into segments
(`eqllm.config.kinds.segments`), a run of one kind through `run_blocks` (with its per-layer
flags), a repeated pattern of kinds through `run_groups`; remat policies and the per-layer hook
(`each_layer`) of FSDP.

Why `each_layer` is a trace-time hook (a ContextVar read while tracing) and not an argument: the
training step sets it once around everything it differentiates, and every model traced inside
reaches this loop by its own road: the objective's model, called directly or through
`routed_logps` (preference, GRPO), and the distillation teacher, gathered layer by layer too,
through `CausalLM.__call__`, `routed`, `routing` or `hidden`. An argument would be threaded
through all of those and every objective; a field of `CausalLM` would change its tree structure
(checkpoints, `with_config`, compiled-function caches). The hook changes where XLA places the
gathers, never the values; it is set in one place (`eqllm.train.step`). What a layer's mixture of
experts needs from the mesh is no hook: the FSDP layer hook passes it to the layer's call
(`Block.routed(..., experts=...)`, `eqllm.nn.dispatch.ExpertHooks`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from eqllm.config import ModelConfig
from eqllm.config.kinds import Segment, layer_stacks, segments, stack_field, stack_layers
from eqllm.config.per_layer import kv_sources
from eqllm.nn import Block, Routing
from eqllm.stack.inputs import layer_inputs, shared_fields

# The name "offload" gives each layer's input (`_offloaded_input`): the one value it keeps, in
# host memory rather than the device's, as MaxText's "decoder_layer_input: offload" does.
LAYER_INPUT = "layer_input"
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


# Applied to each layer's Block inside the layer loop's body (see `each_layer`): returns what
# runs in the block's place, called as block(x, positions, local, segment_ids, rotate), plus the
# keywords of `Block.routed` a layer may need (per_layer_input, shared).
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


def checkpointed(layer: Callable, config: ModelConfig, *, hooked: bool, **kwargs) -> Callable:
    """One layer's call under the config's remat policy; without remat, a layer run through an
    `each_layer` hook keeps everything but its gathered weights for the backward pass. `kwargs`
    go to `jax.checkpoint` (static_argnums)."""
    if config.remat == "offload":
        layer = _offloaded_input(layer)
    if config.remat != "none":
        return jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat], **kwargs)
    if hooked:
        return jax.checkpoint(layer, policy=_save_all_but_gathers, **kwargs)
    return layer


def _offloaded_input(layer: Callable) -> Callable:
    """`layer` with the floating-point arrays of its first argument (the residual stream, alone
    or in a pipeline stage's carry) named `LAYER_INPUT`, which the "offload" policy moves to
    host memory. Only the name's output is kept: the recomputation reads it, not the input."""

    def named(h, *args):
        h = jax.tree.map(
            lambda a: (
                checkpoint_name(a, LAYER_INPUT) if jnp.issubdtype(a.dtype, jnp.inexact) else a
            ),
            h,
        )
        return layer(h, *args)

    return named


def run_blocks(
    blocks: Block,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    first: int = 0,
    per_layer: Float[Array, "layers *batch seq d"] | None = None,
    shared: dict | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply the stacked blocks in order: `lax.scan` or an unrolled Python loop (see below).

    `per_layer`: every layer of the model's per-layer inputs (`eqllm.nn.PerLayerInputs`),
    scanned alongside the weights from layer `first`; `shared`: kv-shared layers' sources'
    keys and values by window flag (`eqllm.stack.inputs.shared_fields`).

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
    inputs = None if per_layer is None else per_layer[first : first + n_layers]
    xs = (params, _traced(local), _traced(rotate), inputs)

    hook = _LAYER_HOOK.get()

    def step(h, layer):
        layer_params, layer_local, layer_rotate, layer_input = layer
        block = eqx.combine(layer_params, static)
        extra = layer_inputs(layer_input, shared, layer_local)
        if hook is not None:
            return hook(block)(h, positions, layer_local, segment_ids, layer_rotate, **extra)
        return block.routed(h, positions, layer_local, segment_ids, layer_rotate, **extra)

    step = checkpointed(step, config, hooked=hook is not None)
    # Remat needs the loop: unrolled, XLA computes each block's recomputation as early as its
    # input exists, so the activations live as long as without remat (llama-mini at 2 x 256:
    # 480 MiB unrolled vs 360 MiB scanned, 493 / 449 MiB without remat).
    if config.scan_layers or config.remat != "none":
        return jax.lax.scan(step, x, xs)
    routings = []
    for i in range(n_layers):  # each layer's flags are known here: Python bools
        flags = (layer_flag(local, i), layer_flag(rotate, i))
        layer_input = None if inputs is None else inputs[i]
        x, routing = step(x, (jax.tree.map(lambda a, i=i: a[i], params), *flags, layer_input))
        routings.append(routing)
    return x, _stacked(routings)


def run_groups(
    stacks: dict[str, Block | None],
    segment: Segment,
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    per_layer: Float[Array, "layers *batch seq d"] | None = None,
    shared: dict | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply the layers of `segment`, a pattern of kinds repeated (a hybrid's linear and
    attention layers, Llama 4 Maverick's dense and expert layers), from `stacks` (CausalLM
    field -> stacked Block, `eqllm.config.kinds.stack_layers`).

    Each kind's layers in the segment are a contiguous slice of its stack, viewed as (repeats,
    layers of that kind per group, ...), with their per-layer flags (`layer_flags`) beside them;
    `lax.scan` runs over the groups: one compiled body (the group's layers in pattern order)
    serves any depth. Remat, the `each_layer` hook and `scan_layers=False` act per layer as in
    `run_blocks`, and so do `per_layer` and `shared` (by stack field). Returns the output and
    the `Routing` of the segment's layers with experts in layer order (None without experts).
    """
    fields = [stack_field(config, kind) for kind in segment.pattern]
    index = {i: j for layers in stack_layers(config).values() for j, i in enumerate(layers)}
    flags = layer_flags(config)
    grouped, statics = {}, {}
    for field in dict.fromkeys(fields):
        per_group = fields.count(field)
        mine = [
            segment.start + g * len(fields) + p
            for g in range(segment.repeats)
            for p, f in enumerate(fields)
            if f == field
        ]
        params, statics[field] = eqx.partition(stacks[field], eqx.is_array)
        params = _slice(params, index[mine[0]], len(mine))
        grouped[field] = (
            jax.tree.map(lambda a, c=per_group: a.reshape(-1, c, *a.shape[1:]), params),
            *(None if f is None else f[mine].reshape(-1, per_group) for f in flags),
            None
            if per_layer is None
            else per_layer[np.array(mine)].reshape(-1, per_group, *per_layer.shape[1:]),
        )
    hook = _LAYER_HOOK.get()
    shared = shared or {}

    def layer(h, params, local, rotate, inputs, field):
        block = eqx.combine(params, statics[field])
        extra = layer_inputs(inputs, shared.get(field), local)
        if hook is not None:
            return hook(block)(h, positions, local, segment_ids, rotate, **extra)
        return block.routed(h, positions, local, segment_ids, rotate, **extra)

    layer = checkpointed(layer, config, hooked=hook is not None, static_argnums=5)

    def group(h, xs):
        seen = dict.fromkeys(xs, 0)
        routings = []
        for field in fields:
            i = seen[field]
            params, local, rotate, inputs = xs[field]
            pick = jax.tree.map(lambda a, i=i: a[i], params)
            inputs = None if inputs is None else inputs[i]
            h, out = layer(h, pick, _pick(local, i), _pick(rotate, i), inputs, field)
            seen[field] += 1
            routings.append(out)
        return h, _stacked([r for r in routings if r is not None] or [None])

    if config.scan_layers or config.remat != "none":
        traced = {f: (p, _traced(a), _traced(b), c) for f, (p, a, b, c) in grouped.items()}
        x, routing = jax.lax.scan(group, x, traced)
    else:
        outs = []
        for g in range(segment.repeats):  # each layer's flags are known here: Python bools
            x, out = group(x, jax.tree.map(lambda a, g=g: a[g], grouped))
            outs.append(out)
        routing = _stacked(outs)
    # (groups, layers with experts per group, ...) -> (layers, ...), in layer order
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), routing)


def run_stacks(
    stacks: dict[str, Block | None],
    x: Float[Array, "*batch seq d_model"],
    positions: Int[Array, "*batch seq"] | None,
    config: ModelConfig,
    segment_ids: Int[Array, "*batch seq"] | None = None,
    per_layer: Float[Array, "layers *batch seq d"] | None = None,
) -> tuple[Float[Array, "*batch seq d_model"], Routing | None]:
    """Apply every layer in order: `stacks` maps each CausalLM field ("blocks", "dense_blocks",
    "linear_blocks") to its stacked Block, and `ModelConfig.layer_kinds` says which holds each
    layer. The kinds are cut into `segments`: a run of one kind goes through `run_blocks` (its
    slice of one stack: a uniform model's whole stack; DeepSeek's dense prefix, then the rest),
    a repeated pattern of kinds through `run_groups`; each segment is one compiled body.
    `per_layer`: the model's per-layer inputs (`eqllm.nn.PerLayerInputs`), layers leading.
    Returns the output and the `Routing` of every layer with experts, in layer order (None
    without experts).

    With kv-shared layers (`attention.kv_shared_layers`) the segments are also cut at each
    source layer, whose keys and values are computed from its input (`Block.keys_values`) for
    the shared layers after it."""
    index = {i: j for layers in stack_layers(config).values() for j, i in enumerate(layers)}
    kinds, local = config.layer_kinds(), config.local_layers()
    sources, kv = set(kv_sources(config).values()), {}
    bounds = sorted({0, *sources, config.n_layers})  # spans cut at each source
    routings = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        if start in sources:  # the source of its type's shared layers: its keys and values
            params, static = eqx.partition(stacks[layer_stacks(config)[start]], eqx.is_array)
            block = eqx.combine(jax.tree.map(lambda a, j=index[start]: a[j], params), static)
            at = jnp.arange(x.shape[-2]) if positions is None else positions
            flags = [layer_flag(f, start) for f in layer_flags(config)]
            kv[local[start]] = block.keys_values(x, at, *flags)
        shared = shared_fields(config, kv)
        for part in segments(kinds[start:stop]):
            segment = Segment(part.start + start, part.pattern, part.repeats)
            if len(segment.pattern) > 1:
                x, routing = run_groups(
                    stacks, segment, x, positions, config, segment_ids, per_layer, shared
                )
            else:
                field = stack_field(config, segment.pattern[0])
                stack = _slice(stacks[field], index[segment.start], segment.repeats)
                x, routing = run_blocks(
                    stack, x, positions, config, segment_ids, segment.start, per_layer,
                    shared.get(field),
                )  # fmt: skip
            routings.append(routing)
    routings = [r for r in routings if r is not None]
    if not routings:
        return x, None
    if len(routings) == 1:
        return x, routings[0]
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *routings)


def layer_extra(
    config: ModelConfig, i: int, layers, x, positions, cache, inputs, shared: dict
) -> dict:
    """Layer i's keywords for its cached call (`Block.cached`) beyond (x, positions, cache):
    its per-layer input (`inputs`, from `CausalLM.per_layer_inputs`) and, for a kv-shared
    layer, its source's cache before the chunk and the chunk's keys and values; a source
    layer puts those in `shared` (by layer index) before it runs. Called layer by layer, in
    order, with each layer's input `x` and cache (the serving engine: its view of the pool)."""
    extra = {} if inputs is None else {"per_layer_input": inputs[i]}
    sources = kv_sources(config)
    if i in sources.values():
        local, rotate = (layer_flag(f, i) for f in layer_flags(config))
        shared[i] = (cache, *layers[i].keys_values(x, positions, local, rotate))
    if i in sources:
        extra["shared"] = shared[sources[i]]
    return extra


def _slice(stack: Block, first: int, n: int) -> Block:
    """Layers first .. first + n - 1 of a stacked Block (the stack itself when it is all)."""
    params, static = eqx.partition(stack, eqx.is_array)
    if first == 0 and jax.tree.leaves(params)[0].shape[0] == n:
        return stack
    return eqx.combine(jax.tree.map(lambda a: a[first : first + n], params), static)


def _pick(flags, i: int):
    """Layer i's flag of a group: a Python bool from host flags (unrolled), else traced."""
    if flags is None:
        return None
    return bool(flags[i]) if isinstance(flags, np.ndarray) else flags[i]


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
