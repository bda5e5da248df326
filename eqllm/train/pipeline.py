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
schedule, not the result. What a stage runs (a stack of layers alike, or whole groups of a
hybrid's pattern of kinds) and which models can run so: `eqllm.train.stages`.

A mixture of experts: each layer of a stage returns its `Routing` (router logits, expert load,
dropped copies), collected per tick beside the activations. Stage i holds microbatch j at tick
i + j; the other ticks are the bubble, whose routings (of the zeros an idle stage runs on) are
never read. The routings of every (stage, microbatch) are put back in layer and row order, so
the balance loss and the expert load are computed from the same numbers as on one device
(`eqllm.train.balance`). DeepSeek's dense prefix (`moe.dense_layers`) runs before the stages, on
every device, as the embeddings do; the stages split the expert layers after it. With an fsdp
axis, each stage gathers one layer's weights at a time and keeps the experts split over fsdp
(the FSDP layer hook, `eqllm.sharding.FsdpGather`, the same as without a pipeline): token
dispatch (`eqllm.sharding.ExpertDispatch`, a `shard_map` that `jax.vmap` batches over the stage
axis onto `pipeline`) or the dense expert product runs expert-parallel inside the stage; the
grouped matmul (`jax.lax.ragged_dot`, or megablox on TPU) takes each stage's own group sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from eqllm.config import ModelConfig
from eqllm.config.kinds import pipeline_layers
from eqllm.data import DataError
from eqllm.eval.loss import masked_mean
from eqllm.model import CausalLM
from eqllm.nn import Routing
from eqllm.sharding import RULES, MeshError, fsdp_gather
from eqllm.stack import dtype_of, each_layer, run_blocks
from eqllm.train.stages import check_stages, stage_program
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
        prefix, staged = pipeline_layers(config)
        before = f" after {prefix} dense layers" if prefix else ""
        return (
            f"pipeline: {self.stages} stages x {staged // self.stages} layers{before}, "
            f"{self.microbatches} microbatches, bubble fraction {self.bubble:.3f} "
            f"= ({self.stages}-1)/({self.microbatches}+{self.stages}-1)"
        )

    def check(self, config: ModelConfig, rows: int) -> None:
        """Raise unless the layers split into equal stages (`check_stages`) and `rows` into
        microbatches (whose rows split over the mesh's batch axes)."""
        check_stages(config, self.stages)
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
        return self.forward(model, tokens, positions, segment_ids)[0]

    def forward(
        self,
        model: CausalLM,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq d_model"], Routing | None]:
        """`hidden` and, for a mixture of experts, every expert layer's `Routing` in layer and
        row order, as `CausalLM.routing` gives it (None without experts)."""
        cfg = model.config
        self.check(cfg, tokens.shape[0])
        in_order = positions is None
        if in_order:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        model = cast_floating(model, dtype_of(cfg.compute_dtype))  # as CausalLM.hidden does
        x = model.embed_inputs(tokens, positions)  # (batch, seq, d_model)
        rows, seq, width = x.shape
        m = self.microbatches
        prefix, _ = pipeline_layers(cfg)
        if prefix:  # DeepSeek's dense prefix: before the stages, its rows over every device
            hook = self._layer_hook()
            with each_layer(hook) if hook is not None else contextlib.nullcontext():
                x, _ = run_blocks(
                    model.dense_blocks,
                    self._spread(x),
                    None if in_order else positions,
                    cfg,
                    segment_ids,
                )

        def split(a):
            # Microbatch j takes rows j, j + m, j + 2m, ...: the row axis stays split over the
            # batch's mesh axes with no data movement (contiguous microbatches would move rows).
            if a is None:
                return None
            return self._constrain(a.reshape(rows // m, m, *a.shape[1:]).swapaxes(0, 1), None)

        micro = (split(x), split(None if in_order else positions), split(segment_ids))
        out, routing = self._run(model, micro, cfg)  # (m, rows/m, seq, d_model)
        x = out.swapaxes(0, 1).reshape(rows, seq, width)
        # The head and loss need no stages: spread their rows over the pipeline devices too.
        return model.final_norm(self._spread(x)), routing

    def _spread(self, x):
        """Rows over the pipeline and batch axes, for what runs outside the stages."""
        if self.mesh is None or x.shape[0] % (self.stages * self._batch_split()):
            return x
        spec = PartitionSpec(("pipeline", *self._batch_axes()))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _gather(self):
        """The mesh's FSDP gathers (`eqllm.sharding.FsdpGather`), or None without an fsdp split."""
        return None if self.mesh is None else fsdp_gather(self.mesh)

    def _layer_hook(self):
        """The FSDP layer hook of the mesh (one layer's weights gathered at a time, experts kept
        split: `eqllm.sharding.FsdpGather.layer`), or None without an fsdp split."""
        gather = self._gather()
        return None if gather is None else gather.layer

    def wrap(self, model: CausalLM) -> Pipelined:
        """`model` with its stacked blocks run as this schedule: what the train step hands an
        objective's loss in place of the model (the same logits, any objective). With an fsdp
        split the arrays outside the stacks (embedding, final norm, head) are gathered once, as
        without a pipeline (`FsdpGather.outside_layers`): looked up from a table split over
        d_model, the embeddings would be replicated on every device to reach the batch split."""
        gather = self._gather()
        return Pipelined(model if gather is None else gather.outside_layers(model), self)

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

    def _run(self, model: CausalLM, micro: tuple, config: ModelConfig):
        """The GPipe schedule over the model's layers after its dense prefix
        (`eqllm.train.stages.stage_program`); returns each microbatch's output and the layers'
        `Routing` (None without experts).

        `micro` is (activations (m, rows/m, seq, d_model), positions, segment ids), the last
        two (m, rows/m, seq) or None; positions and segment ids move with their activations."""
        s, m = self.stages, self.microbatches
        staged, stage, flags = stage_program(model, config, s, self._layer_hook())
        staged = jax.tree.map(self._stage_split, staged)

        # The stage axis is the pipeline axis: constraints inside a stage (the FSDP hook's)
        # keep it there, and do not gather the stages onto every device.
        spmd = None if self.mesh is None else "pipeline"

        def tick(state, inp):
            # Stage 0 takes the next microbatch, stage i what stage i-1 produced last tick.
            shifted = jax.tree.map(
                lambda i, st: self._constrain(jnp.concatenate([i[None], st[:-1]]), "pipeline"),
                inp,
                state,
            )
            out, routing = jax.vmap(stage, spmd_axis_name=spmd)(staged, flags, shifted)
            out = jax.tree.map(lambda a: self._constrain(a, "pipeline"), out)
            return out, (out[0][-1], routing)

        # After the last microbatch stage 0 runs on zeros whose results are never read.
        idle = jax.tree.map(lambda a: jnp.zeros((s - 1, *a.shape[1:]), a.dtype), micro)
        state = jax.tree.map(
            lambda a: self._constrain(jnp.zeros((s, *a.shape[1:]), a.dtype), "pipeline"), micro
        )
        inputs = jax.tree.map(lambda a, i: jnp.concatenate([a, i]), micro, idle)
        _, (last, routing) = jax.lax.scan(tick, state, inputs)
        # microbatch j leaves the last stage at tick j + s - 1
        return last[s - 1 :], None if routing is None else self._routing(routing, m)

    def _routing(self, routing: Routing, m: int) -> Routing:
        """Per tick and stage (ticks, stages, layers per stage, ...) -> per layer, as one device
        computes it: stage i's routing of microbatch j is tick i + j's (the bubble's ticks,
        idle stages running on zeros, are left out); the microbatches' rows back in batch
        order, their loads and dropped copies summed."""
        s = self.stages
        ticks = np.arange(s)[:, None] + np.arange(m)[None, :]  # (stages, microbatches)
        stage = np.arange(s)[:, None]
        logits, load, dropped = (a[ticks, stage] for a in routing)  # (s, m, layers/s, ...)
        # (s, m, layers/s, rows/m, seq, E) -> (layers, rows, seq, E), row r*m + j from [j, r]
        logits = jnp.moveaxis(logits, 1, 3)
        logits = logits.reshape(-1, logits.shape[2] * m, *logits.shape[4:])
        load = load.sum(1).reshape(-1, load.shape[-1])  # (layers, E)
        return Routing(logits, load, dropped.sum(1).reshape(-1))

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
    `routing`, `routed` and `__call__` give what `CausalLM`'s give (logits, and a mixture of
    experts' `Routing` or router logits)."""

    model: CausalLM
    pipeline: Pipeline = eqx.field(static=True)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def blocks(self):
        """The model's main stack (a mixture of experts' balance terms read its experts)."""
        return self.model.blocks

    def routing(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], Routing | None]:
        hidden, routing = self.pipeline.forward(self.model, tokens, positions, segment_ids)
        return self.model.logits(hidden), routing

    def routed(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], Float[Array, "layers batch seq experts"] | None]:
        logits, routing = self.routing(tokens, positions, segment_ids)
        return logits, None if routing is None else routing.logits

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        return self.routed(tokens, positions, segment_ids)[0]
