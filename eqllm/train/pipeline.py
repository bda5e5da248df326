"""Pipeline parallelism: the stacked layers split into stages, microbatches scheduled GPipe-style.

GPipe (Huang et al., 2019) with the vmap-over-stages pattern of praxis and MaxText: the stacked
blocks' `layers` axis, sharded over the mesh's `pipeline` axis (`eqllm.sharding.RULES`), is
reshaped to [stages, layers_per_stage], so each device of a pipeline group holds one contiguous
stage. Every tick of a `lax.scan` runs all stages at once (`jax.vmap` over the stage axis, which
XLA partitions over `pipeline`), each on the activation its predecessor produced the tick
before; shifting the activations one stage along is a collective permute between neighbours.
Microbatch m enters stage 0 at tick m and leaves the last stage at tick m + stages - 1, so
microbatches + stages - 1 ticks run and a stage idles for stages - 1 of them: the bubble
fraction (stages - 1) / (microbatches + stages - 1). The backward pass is the scan's transpose.

The embeddings, final norm, head and loss run outside the stages on the whole batch; the head's
rows are spread over the pipeline devices too, so no stage computes every row's logits. The
loss is the mean over every target of the batch, as without a pipeline: microbatches change the
schedule, not the result.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from eqllm.config import ModelConfig
from eqllm.config.kinds import stack_layers
from eqllm.data import DataError
from eqllm.eval.loss import masked_mean
from eqllm.model import CausalLM
from eqllm.sharding import RULES, MeshError
from eqllm.stack import REMAT_POLICIES, dtype_of, layer_flags
from eqllm.trees import cast_floating


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """`stages` contiguous runs of layers fed `microbatches` microbatches per batch.

    `mesh` (with a `pipeline` axis of size `stages`) places the stages; None computes the same
    schedule on one device (the values do not depend on it).
    """

    stages: int
    microbatches: int
    mesh: Mesh | None = None

    def __post_init__(self):
        for name in ("stages", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"pipeline {name}={value!r} must be a positive integer")
        if self.mesh is not None and self.mesh.shape["pipeline"] != self.stages:
            raise MeshError(
                f"pipeline of {self.stages} stages on a mesh with pipeline="
                f"{self.mesh.shape['pipeline']}; make mesh.pipeline equal the stages"
            )

    @property
    def bubble(self) -> float:
        """The share of a stage's ticks spent idle: (stages - 1) / (microbatches + stages - 1)."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    def describe(self, config: ModelConfig) -> str:
        return (
            f"pipeline: {self.stages} stages x {config.n_layers // self.stages} layers, "
            f"{self.microbatches} microbatches, bubble fraction {self.bubble:.3f} "
            f"= ({self.stages}-1)/({self.microbatches}+{self.stages}-1)"
        )

    def check(self, config: ModelConfig, rows: int) -> None:
        """Raise unless the layers split into equal stages and `rows` into microbatches (whose
        rows split over the mesh's batch axes)."""
        if config.moe is not None:
            raise MeshError(
                "a mixture of experts does not run in a pipeline yet (the stages would drop its "
                "load-balancing loss); set mesh.pipeline=1 and split the experts over fsdp"
            )
        if config.linear is not None:
            raise MeshError(
                "a hybrid stack (linear-attention and attention layers) does not run in a "
                "pipeline yet (the stages hold one stack of layers); set mesh.pipeline=1"
            )
        if config.per_layer is not None or len(stack_layers(config)) > 1:
            raise MeshError(
                f"a model with layer kinds {sorted(set(config.layer_kinds()))} or per-layer inputs "
                f"(per_layer={config.per_layer}) does not run in a pipeline yet (the stages hold "
                "one stack of layers and no per-layer inputs); set mesh.pipeline=1"
            )
        if config.n_layers % self.stages:
            raise MeshError(
                f"pipeline={self.stages} does not divide n_layers={config.n_layers}: each stage "
                "runs an equal, contiguous run of layers; choose a pipeline size that divides "
                f"{config.n_layers}"
            )
        if rows % self.microbatches:
            raise DataError(
                f"a batch of {rows} sequences does not split into train.microbatches="
                f"{self.microbatches} equal microbatches; choose a divisor of {rows}"
            )
        split = self._batch_split()
        if (rows // self.microbatches) % split:
            raise DataError(
                f"train.microbatches={self.microbatches} leaves {rows // self.microbatches} "
                f"sequences per microbatch, which do not split over the {split} data*fsdp "
                "devices; use fewer microbatches or a larger batch"
            )

    def hidden(
        self,
        model: CausalLM,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq d_model"]:
        """The final-norm hidden states, as `CausalLM.hidden(tokens, positions, segment_ids)`
        computes them; positions and segment ids travel through the stages with their rows."""
        cfg = model.config
        self.check(cfg, tokens.shape[0])
        in_order = positions is None
        if in_order:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        model = cast_floating(model, dtype_of(cfg.compute_dtype))  # as CausalLM.hidden does
        x = model.embed_inputs(tokens, positions)  # (batch, seq, d_model)
        rows, seq, width = x.shape
        m = self.microbatches

        def split(a):
            # Microbatch j takes rows j, j + m, j + 2m, ...: the row axis stays split over the
            # batch's mesh axes with no data movement (contiguous microbatches would move rows).
            if a is None:
                return None
            return self._constrain(a.reshape(rows // m, m, *a.shape[1:]).swapaxes(0, 1), None)

        micro = (split(x), split(None if in_order else positions), split(segment_ids))
        out = self._run(model.blocks, micro, cfg)  # (m, rows/m, seq, d_model)
        x = out.swapaxes(0, 1).reshape(rows, seq, width)
        if self.mesh is not None and rows % (self.stages * self._batch_split()) == 0:
            # The head and loss need no stages: spread their rows over the pipeline devices too.
            x = jax.lax.with_sharding_constraint(
                x, NamedSharding(self.mesh, PartitionSpec(("pipeline", *self._batch_axes())))
            )
        return model.final_norm(x)

    def wrap(self, model: CausalLM) -> Pipelined:
        """`model` with its stacked blocks run as this schedule: what the train step hands an
        objective's loss in place of the model (the same logits, any objective)."""
        return Pipelined(model, self)

    def loss(
        self,
        model: CausalLM,
        batch: Int[Array, "batch window"],
        mask: Bool[Array, "batch window-1"] | None = None,
        positions: Int[Array, "batch window-1"] | None = None,
        segment_ids: Int[Array, "batch window-1"] | None = None,
    ) -> Float[Array, ""]:
        """Mean next-token cross entropy over the (masked-in) targets (`eqllm.train.mean_loss`);
        `positions` and `segment_ids` as `hidden` takes them (of the inputs `batch[:, :-1]`)."""
        logits = self.wrap(model)(batch[:, :-1], positions, segment_ids)  # fp32
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return masked_mean(nll, mask)

    def _run(self, blocks, micro: tuple, config: ModelConfig):
        """The GPipe schedule over the stacked `blocks`; returns each microbatch's output.

        `micro` is (activations (m, rows/m, seq, d_model), positions, segment ids), the last
        two (m, rows/m, seq) or None; positions and segment ids move with their activations."""
        s = self.stages
        params, static = eqx.partition(blocks, eqx.is_array)
        # [layers, ...] -> [stages, layers_per_stage, ...]: stage i holds layers i*k .. i*k+k-1.
        staged = jax.tree.map(lambda a: self._stage_split(a.reshape(s, -1, *a.shape[1:])), params)
        # Per-layer flags (local, rotate), None where every layer is alike, staged like the weights.
        flags = tuple(
            None if f is None else jnp.asarray(f).reshape(s, -1) for f in layer_flags(config)
        )

        def layer(carry, xs):
            h, positions, segments = carry
            layer_params, local, rotate = xs
            block = eqx.combine(layer_params, static)
            return (block(h, positions, local, segments, rotate), positions, segments), None

        if config.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat])

        def stage(stage_params, stage_flags, h):
            # A stage always scans its layers (the flags are then data, not Python bools).
            return jax.lax.scan(layer, h, (stage_params, *stage_flags))[0]

        def tick(state, inp):
            # Stage 0 takes the next microbatch, stage i what stage i-1 produced last tick.
            shifted = jax.tree.map(
                lambda i, st: self._constrain(jnp.concatenate([i[None], st[:-1]]), "pipeline"),
                inp,
                state,
            )
            out = jax.vmap(stage)(staged, flags, shifted)
            out = jax.tree.map(lambda a: self._constrain(a, "pipeline"), out)
            return out, out[0][-1]

        # After the last microbatch stage 0 runs on zeros whose results are never read.
        idle = jax.tree.map(lambda a: jnp.zeros((s - 1, *a.shape[1:]), a.dtype), micro)
        state = jax.tree.map(
            lambda a: self._constrain(jnp.zeros((s, *a.shape[1:]), a.dtype), "pipeline"), micro
        )
        inputs = jax.tree.map(lambda a, i: jnp.concatenate([a, i]), micro, idle)
        _, last = jax.lax.scan(tick, state, inputs)
        return last[s - 1 :]  # microbatch j leaves the last stage at tick j + s - 1

    def _batch_split(self) -> int:
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in self._batch_axes())

    def _batch_axes(self) -> tuple[str, ...]:
        axes = RULES["batch"]
        return (axes,) if isinstance(axes, str) else tuple(axes)

    def _constrain(self, x, stage_axis: str | None):
        """Pin (stage, microbatch rows, ...) activations: stages over `pipeline`, rows over the
        batch axes."""
        if self.mesh is None:
            return x
        spec = PartitionSpec(stage_axis, RULES["batch"])
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _stage_split(self, a):
        """Keep a stage's weights on its devices; XLA chooses the rest of the layout."""
        if self.mesh is None:
            return a
        spec = PartitionSpec("pipeline", *([PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))


class Pipelined(eqx.Module):
    """A `CausalLM` whose stacked blocks run as `pipeline`'s GPipe schedule (`Pipeline.wrap`):
    `routed` and `__call__` give the logits `CausalLM` would, with no router logits (a
    pipeline refuses a mixture of experts)."""

    model: CausalLM
    pipeline: Pipeline = eqx.field(static=True)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def routed(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], None]:
        hidden = self.pipeline.hidden(self.model, tokens, positions, segment_ids)
        return self.model.logits(hidden), None

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        return self.routed(tokens, positions, segment_ids)[0]
