"""What one pipeline stage runs (`eqllm.train.Pipeline`), and which stacks of layers can run so.

The stages split the layers after a dense prefix (`eqllm.config.kinds.pipeline_layers`) into
equal, contiguous runs; those layers must repeat one pattern of kinds (`segments` gives one
segment), whose repeats the stages divide, so that every stage runs the same program on its own
weights. A stack of one kind (every dense model, Mixtral, DeepSeek-V3's expert layers) is one
stacked Block, each stage a `lax.scan` over its layers with their per-layer flags beside them. A
pattern of several kinds (a hybrid's linear-attention and attention layers, each kind its own
stack) gives each stage whole groups of the pattern: each kind's stack viewed as [stages,
layers of that kind per stage, ...], run in pattern order by `eqllm.stack.run_groups`.
"""

from __future__ import annotations

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp

from eqllm.config import ModelConfig
from eqllm.config.kinds import Segment, layer_kinds, pipeline_layers, segments, stack_field
from eqllm.sharding import MeshError
from eqllm.stack import checkpointed, each_layer, layer_flags, run_groups


def staged_segment(config: ModelConfig) -> Segment | None:
    """The layers the stages split, after the dense prefix, as one pattern of kinds repeated
    (None when they are not one)."""
    prefix, _ = pipeline_layers(config)
    cut = segments(layer_kinds(config)[prefix:])
    return Segment(prefix, cut[0].pattern, cut[0].repeats) if len(cut) == 1 else None


def check_stages(config: ModelConfig, stages: int) -> None:
    """Raise unless `stages` stages can run the layers of `config` (module docstring)."""
    prefix, staged = pipeline_layers(config)
    if config.per_layer is not None or config.attention.kv_shared_layers:
        raise MeshError(
            "per-layer inputs and kv-shared layers (Gemma 4 E2B, E4B) do not run in a pipeline "
            "yet (a shared layer reads an earlier layer's keys, maybe on another stage); set "
            "mesh.pipeline=1"
        )
    if staged % stages:
        what = f"n_layers={config.n_layers}"
        if prefix:
            what = f"the {staged} layers after the {prefix} dense ones (moe.dense_layers)"
        raise MeshError(
            f"pipeline={stages} does not divide {what}: each stage runs an equal, contiguous "
            f"run of layers; choose a pipeline size that divides {staged}"
        )
    segment = staged_segment(config)
    kinds = layer_kinds(config)[prefix:]
    if segment is None:
        raise MeshError(
            f"layers of kinds {list(dict.fromkeys(kinds))} that do not repeat one pattern do not "
            "run in a pipeline: every stage must run the same program; set mesh.pipeline=1"
        )
    if segment.repeats % stages:
        raise MeshError(
            f"pipeline={stages} does not divide the {segment.repeats} repeats of the layers' "
            f"pattern {list(segment.pattern)}: each stage runs whole groups of it; choose a "
            f"pipeline size that divides {segment.repeats}"
        )
    if len(segment.pattern) > 1 and any(f is not None for f in layer_flags(config)):
        raise MeshError(
            f"a pattern of kinds {list(segment.pattern)} with per-layer flags (local/global "
            "windows, NoPE layers) does not run in a pipeline yet: the groups' flags are not "
            "staged; set mesh.pipeline=1"
        )


def stage_program(model, config: ModelConfig, stages: int, hook=None):
    """(the staged weights, `stage(weights, flags, carry) -> (carry, routing)`, the staged
    flags) for `model`'s layers after the dense prefix; `carry` is (activations, positions,
    segment ids) and `routing` each layer's `Routing` in layer order (None without experts).
    `hook`: the FSDP layer hook applied inside the stage (None: none)."""
    segment = staged_segment(config)
    fields = list(dict.fromkeys(stack_field(config, kind) for kind in segment.pattern))
    parts = {f: eqx.partition(getattr(model, f), eqx.is_array) for f in fields}
    # [layers, ...] -> [stages, layers per stage, ...]: stage i holds the i-th run of layers.
    staged = {
        f: jax.tree.map(lambda a: a.reshape(stages, -1, *a.shape[1:]), params)
        for f, (params, _) in parts.items()
    }
    first = segment.start
    # Per-layer flags (local, rotate), None where every layer is alike, staged like the weights.
    flags = tuple(
        None if f is None else jnp.asarray(f[first:]).reshape(stages, -1)
        for f in layer_flags(config)
    )
    if len(fields) > 1:
        group = Segment(0, segment.pattern, segment.repeats // stages)

        def groups(stage_params, _, carry):
            h, positions, segment_ids = carry
            stacks = {f: eqx.combine(stage_params[f], parts[f][1]) for f in fields}
            with each_layer(hook) if hook is not None else contextlib.nullcontext():
                h, routing = run_groups(stacks, group, h, positions, config, segment_ids)
            return (h, positions, segment_ids), routing

        return staged, groups, flags
    (field,) = fields
    static = parts[field][1]

    def layer(carry, xs):
        h, positions, segment_ids = carry
        layer_params, local, rotate = xs
        block = eqx.combine(layer_params, static)
        run = block.routed if hook is None else hook(block)
        h, routing = run(h, positions, local, segment_ids, rotate)
        return (h, positions, segment_ids), routing

    layer = checkpointed(layer, config, hooked=hook is not None)

    def stage(stage_params, stage_flags, carry):
        # A stage always scans its layers (the flags are then data, not Python bools).
        return jax.lax.scan(layer, carry, (stage_params[field], *stage_flags))

    return staged, stage, flags
