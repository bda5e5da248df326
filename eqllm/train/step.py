"""The training step: gradient, optimizer update and metrics in one compiled call.

`TrainStep(optimizer, lr_schedule, objective=...)` is `step(model, opt_state, batch) ->
(model, opt_state, metrics)`: one `eqx.filter_jit` function with the model and optimizer state
donated (their buffers are reused for the results: do not touch the arguments after the call).
It takes one batch (a dict of arrays with a leading batch axis) and one loss, the objective's
`loss(model, batch)`; a pipeline schedule wraps the model that loss runs, so every objective
runs pipelined alike. The batch of `grad_accum * micro_batch` rows is split into micro-batches
whose gradients are summed with `lax.scan` inside the same compiled call. A step whose loss or
gradient norm is not finite is not applied: the returned model and state are the inputs, and
`metrics["finite"]` is False. With optim.skip_spike_window a step whose loss or gradient norm
spikes is not applied either (`eqllm.train.stability`; `metrics["spike"]`). A mixture of
experts' correction bias (DeepSeek's auxiliary-loss-free balancing) moves after the update
(`eqllm.train.balance`); a model without one is left as the optimizer made it.
"""

from __future__ import annotations

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from eqllm.config.kinds import stack_layers
from eqllm.data import DataError
from eqllm.errors import EqllmError
from eqllm.lora import trainable, with_dropout_keys
from eqllm.sharding import fsdp_gather, shardings_like_params
from eqllm.stack import each_layer
from eqllm.train.balance import bias_update
from eqllm.train.objectives.lm import LanguageModel, next_token_loss
from eqllm.train.pipeline import Pipeline
from eqllm.train.stability import spike_state


def _layer_grad_norms(grads) -> dict[str, Float[Array, " layers"]]:
    """{"grad_norm/layer": L2 norm of each layer's gradient}: the stacked blocks' leaves
    reduced over all but axis 0, in layer order; {} for a model without stacked blocks."""

    def norms(stack, n: int):
        leaves = [g for g in jax.tree.leaves(stack) if g is not None]
        if not leaves:  # a stack without trainable arrays (LoRA targets none of its layers)
            return jnp.zeros((n,), jnp.float32)
        # Summed over the other axes in place: reshaping a split array to (layers, -1) would
        # make XLA gather every layer's whole gradient (under fsdp) just for this metric.
        squares = [
            jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim))) for g in leaves
        ]
        return jnp.sqrt(sum(squares))

    if getattr(grads, "blocks", None) is None:
        return {}
    # Each stack's layers, then put in layer order (`eqllm.config.kinds.stack_layers`).
    stacks = stack_layers(grads.config)
    stacked = jnp.concatenate([norms(getattr(grads, f), len(ls)) for f, ls in stacks.items()])
    order = np.argsort(np.concatenate([np.array(layers) for layers in stacks.values()]))
    return {"grad_norm/layer": stacked[order]}


training_loss = next_token_loss  # the language model's loss, by its older name


def _step_count(opt_state) -> Int[Array, ""]:
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[0][1] if counts else jnp.zeros((), jnp.int32)


class TrainStep:
    """`step(model, opt_state, batch) -> (model, opt_state, metrics)`; see module docstring.

    Arguments:
        optimizer, lr_schedule: the update (optax) and its learning rate per step count (a
            metric only: the optimizer applies its own).
        objective: what the step minimises, any object with `loss(model, batch) -> (loss,
            parts)` (`eqllm.train.objectives`; default the language model's cross entropy).
            An Equinox module's array fields (a teacher) are passed to the compiled step as
            arguments it never donates; `check(model, batch)`, when it has one, runs on the
            host before each step.
        grad_accum: micro-batches per batch, their gradients summed inside the step.
        param_shardings, batch_sharding: where parameters live and how a host batch is laid
            out on the devices (None: one device).
        dropout_seed: LoRA dropout's masks are a function of it and the optimizer's count.
        pipeline: run the model's stacked blocks as this GPipe schedule (the objective's loss
            is computed on `pipeline.wrap(model)`).

    Attributes:
        n_traces: how many times the step has been traced (1 after any number of steps with
            fixed shapes; more means something is recompiling it).

    Metrics (device scalars unless noted): loss (the objective's loss, or the cross entropy it
    reports as "ce"), grad_norm (before clipping), lr, update_norm, param_norm, finite (bool),
    grad_norm/layer (vector over layers, for models with stacked blocks); with spike skipping
    spike (bool: this step was skipped) and spikes (steps skipped so far); the objective's own
    metrics; for a mixture of experts also aux_loss (the load-balancing loss, before its
    coefficient) and expert_load (layers x experts: the fraction of token assignments each
    expert got).
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        lr_schedule: optax.Schedule,
        *,
        objective=None,
        grad_accum: int = 1,
        param_shardings=None,
        batch_sharding=None,
        dropout_seed: int = 0,
        pipeline: Pipeline | None = None,
    ):
        if grad_accum < 1:
            raise EqllmError(f"grad_accum={grad_accum} must be >= 1")
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.grad_accum = grad_accum
        # Where updated parameters must live (a pytree like the model's trainable arrays, from
        # eqllm.sharding.param_shardings); None lets XLA choose (single device).
        self.param_shardings = param_shardings
        # How a host batch (this process's rows) is laid out on the devices; None: one device.
        self.batch_sharding = batch_sharding
        self.n_traces = 0
        # LoRA dropout's masks: a function of this seed and the optimizer's step count.
        self.dropout_seed = dropout_seed
        # Stages and microbatches of each (accumulation) micro-batch's forward and backward.
        self.pipeline = pipeline
        self.objective = LanguageModel() if objective is None else objective
        # The objective's arrays (frozen models) go to the compiled step as arguments, beside
        # the batch: never donated, never baked in as constants. Its other fields are closed
        # over here (they need not be hashable).
        arrays, self._objective_static = eqx.partition(self.objective, eqx.is_array)
        self._frozen, self._frozen_def = jax.tree.flatten(arrays)
        # The batch goes first so that "all-except-first" donates exactly model and opt_state.
        self._compiled = eqx.filter_jit(self._step, donate="all-except-first")

    def __call__(self, model, opt_state, batch: dict | Int[Array, "batch window"] | np.ndarray):
        """One step on `batch`: a dict of arrays with a leading batch axis, as the objective
        reads it (a bare token array stands for {"tokens": array}). Numpy arrays (this
        process's rows) are checked on the host, with no device round trip, then placed by
        `batch_sharding`; device arrays are checked on their device."""
        batch = self._checked(model, batch)
        return self._compiled((self._place(batch), self._frozen), model, opt_state)

    def _checked(self, model, batch) -> dict:
        if not isinstance(batch, dict):
            batch = {"tokens": batch}
        rows = np.shape(jax.tree.leaves(batch)[0])[0]
        if rows % self.grad_accum:
            raise DataError(
                f"batch of {rows} rows does not split into grad_accum={self.grad_accum} "
                "equal micro-batches"
            )
        if self.pipeline is not None:
            self.pipeline.check(model.config, rows // self.grad_accum)
        check = getattr(self.objective, "check", None)
        if check is not None:
            check(model, batch)
        return batch

    def _place(self, batch: dict) -> dict:
        """Host arrays placed on the devices (by `batch_sharding`); device arrays as they are."""
        if self.batch_sharding is None:
            place = jnp.asarray
        else:
            place = lambda a: jax.make_array_from_process_local_data(  # noqa: E731
                self.batch_sharding, a
            )
        return {k: place(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}

    def lower(
        self,
        model,
        opt_state,
        batch: dict | Int[Array, "batch window"] | jax.ShapeDtypeStruct,
        segment_ids: Int[Array, "batch window"] | jax.ShapeDtypeStruct | None = None,
    ):
        """The step lowered ahead of time (`.compile()` it; call the result like the step).

        For compile time, memory (`.compile().compiled.memory_analysis()`) and the HLO
        (`.compile().compiled.as_text()`). `batch` is the step's batch (a bare token array:
        {"tokens": array}; `segment_ids` added to it). `model`, `opt_state` and the batch may
        hold `jax.ShapeDtypeStruct`s (nothing allocated); the result is then a plain
        `jax.stages.Lowered` (`.compile().memory_analysis()`).
        """
        if not isinstance(batch, dict):
            batch = {"tokens": batch}
        if segment_ids is not None:
            batch = {**batch, "segment_ids": segment_ids}
        first = (batch, self._frozen)
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model)):
            return self._compiled.lower(first, model, opt_state)
        # Shapes only (jax.ShapeDtypeStruct leaves, with their shardings): a model too large to
        # allocate here is still compiled and measured. filter_jit would make them static.
        abstract, static = eqx.partition(
            (model, opt_state), lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )

        def step(first, arrays):
            return self._step(first, *eqx.combine(arrays, static))

        return jax.jit(step, donate_argnums=1).lower(first, abstract)

    def _step(self, batch_and_frozen, model, opt_state):
        self.n_traces += 1
        batch, frozen = batch_and_frozen
        objective = eqx.combine(
            jax.tree.unflatten(self._frozen_def, frozen), self._objective_static
        )
        # With LoRA adapters only they are differentiated and updated: the base weights stay in
        # `static` (traced inputs, no gradient, no optimizer state).
        spec = trainable(model)
        count = _step_count(opt_state)
        step_key = jax.random.fold_in(jax.random.key(self.dropout_seed), count)
        keyed = with_dropout_keys(model, step_key)  # the same arrays to train, dropout keys added
        params, static = eqx.partition(keyed, trainable(keyed))
        shardings = None if self.param_shardings is None else eqx.filter(self.param_shardings, spec)

        fsdp = None
        if self.param_shardings is not None and self.pipeline is None:
            # A pipeline runs its stages' layers itself, with the same layer hook inside them.
            fsdp = fsdp_gather(next(s.mesh for s in jax.tree.leaves(self.param_shardings)))

        def loss_of(p, micro):
            m = eqx.combine(p, static)
            if self.pipeline is not None:  # the blocks as stages
                m = self.pipeline.wrap(m)
            elif fsdp is not None:
                m = fsdp.outside_layers(m)
            return objective.loss(m, micro)

        def grad_fn(p, micro):
            # FSDP: each layer's weights are gathered inside the layer loop, and the gradients
            # are reduced straight to the parameters' split placement (eqllm.sharding.fsdp).
            with each_layer(fsdp.layer) if fsdp is not None else contextlib.nullcontext():
                (loss, parts), grads = jax.value_and_grad(loss_of, has_aux=True)(p, micro)
            if shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, shardings)
            return (loss, parts), grads

        if self.grad_accum == 1:
            (loss, parts), grads = grad_fn(params, batch)
        else:
            # Each micro-batch's loss is its own masked mean; with a mask, micro-batches of
            # different response lengths are weighted equally (as transformers' Trainer does).
            micro = jax.tree.map(lambda x: x.reshape(self.grad_accum, -1, *x.shape[1:]), batch)

            def accumulate(carry, mb):
                loss_sum, grad_sum = carry
                (loss, parts), grads = grad_fn(params, mb)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), parts

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), parts = jax.lax.scan(accumulate, (jnp.zeros(()), zeros), micro)
            loss = loss / self.grad_accum
            grads = jax.tree.map(lambda g: g / self.grad_accum, grads)
            parts = jax.tree.map(lambda x: x.mean(0), parts)  # the micro-batches' mean

        grad_norm = optax.tree.norm(grads)
        spikes = spike_state(opt_state) is not None  # optim.skip_spike_window: it reads the loss
        extra = {"loss": loss} if spikes else {}
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params, **extra)
        new_params = eqx.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A non-finite step is dropped: keep the old parameters and optimizer state. A spiking
        # one keeps the parameters; its optimizer state holds the inner state as it was.
        applied = finite & ~new_opt_state.skipped if spikes else finite
        new_params = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new_params, params)
        new_opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_opt_state, opt_state)
        new_params = bias_update(new_params, parts.get("expert_load"), applied, model)
        if shardings is not None:  # keep everything where it was placed
            new_params = jax.lax.with_sharding_constraint(new_params, shardings)
            new_opt_state = jax.lax.with_sharding_constraint(
                new_opt_state, shardings_like_params(new_opt_state, params, shardings)
            )
        metrics = {
            "loss": parts.pop("ce", loss),  # the cross entropy, or the objective's loss
            "grad_norm": grad_norm,
            "lr": jnp.asarray(self.lr_schedule(count), jnp.float32),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(new_params),
            "finite": finite,
            **({"spike": applied != finite, "spikes": new_opt_state.spikes} if spikes else {}),
            **_layer_grad_norms(grads),
            **parts,  # the objective's metrics; a mixture of experts' aux_loss and expert_load
        }
        model = with_dropout_keys(eqx.combine(new_params, static), None)  # as it came in
        return model, new_opt_state, metrics


def init_opt_state(optimizer: optax.GradientTransformation, model, param_shardings=None):
    """The optimizer state for the trainable arrays of `model` (a `CausalLM` or any tree of eqllm
    layers; one compiled call): every floating-point array, or only the LoRA adapters when it
    has them (`eqllm.lora.trainable`).

    With `param_shardings` (eqllm.sharding.param_shardings), moments are placed like their
    parameters and scalars replicated: the layout the train step keeps.
    """
    spec = trainable(model)
    params = eqx.filter(model, spec)
    state = eqx.filter_jit(optimizer.init)(params)
    if param_shardings is None:
        return state
    shardings = eqx.filter(param_shardings, spec)
    return jax.device_put(state, shardings_like_params(state, params, shardings))
