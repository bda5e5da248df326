"""The training step: gradient, optimizer update and metrics in one compiled call.

`make_train_step` returns `train_step(model, opt_state, batch) -> (model, opt_state, metrics)`,
one `eqx.filter_jit` function with the model and optimizer state donated (their buffers are
reused for the results: do not touch the arguments after the call). The batch of
`grad_accum * micro_batch` sequences is split into micro-batches whose gradients are summed with
`lax.scan` inside the same compiled call. A step whose loss or gradient norm is not finite is
not applied: the returned model and state are the inputs, and `metrics["finite"]` is False.
"""

from __future__ import annotations

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm.data import DataError
from eqllm.data.segments import document_positions, document_segments
from eqllm.errors import EqllmError
from eqllm.eval.loss import check_token_range, masked_mean
from eqllm.lora import trainable, with_dropout_keys
from eqllm.model import CausalLM
from eqllm.nn import balance_loss, balanced_bias, chosen_load, expert_load
from eqllm.sharding import fsdp_gather, shardings_like_params
from eqllm.stack import each_layer
from eqllm.train.pipeline import Pipeline


def _layer_grad_norms(grads) -> Float[Array, " layers"]:
    """L2 norm of each layer's gradient: the stacked blocks' leaves reduced over all but axis 0
    (a dense prefix's layers first)."""

    def norms(stack):
        leaves = [g for g in jax.tree.leaves(stack) if g is not None]
        # Summed over the other axes in place: reshaping a split array to (layers, -1) would
        # make XLA gather every layer's whole gradient (under fsdp) just for this metric.
        squares = [
            jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim))) for g in leaves
        ]
        return jnp.sqrt(sum(squares))

    if getattr(grads, "dense_blocks", None) is None:
        return norms(grads.blocks)
    return jnp.concatenate([norms(grads.dense_blocks), norms(grads.blocks)])


def training_loss(
    model: CausalLM,
    batch: Int[Array, "batch window"],
    mask: Bool[Array, "batch window-1"] | None = None,
    positions: Int[Array, "batch window-1"] | None = None,
    segment_ids: Int[Array, "batch window-1"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """What training minimises: the mean next-token cross entropy, plus, for a mixture of
    experts, `router_aux_loss_coef` times the load-balancing loss over all layers (as
    transformers adds it, or DeepSeek-V3's sequence-wise one: moe.balance_loss). Returns it
    with its parts: "ce" and, with experts, "aux_loss" and "expert_load" (per layer, the
    fraction of token assignments each expert received).
    `positions` and `segment_ids` (of the inputs `batch[:, :-1]`) go to the model as they are."""
    # (batch, seq, vocab), fp32
    logits, router_logits = model.routed(batch[:, :-1], positions, segment_ids)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    ce = masked_mean(nll, mask)
    if router_logits is None:
        return ce, {"ce": ce}
    # Every token is routed, padding included (the batches hold no padding); the loss mask
    # marks the targets that are scored, not tokens to leave out of the balance.
    k = model.config.moe.experts_per_token
    moe = model.blocks.mlp
    aux = balance_loss(moe, router_logits, model.config.moe.balance_loss, k)
    plain = moe.plain_routing
    load = expert_load(router_logits, k)[0] if plain else chosen_load(moe, router_logits)
    parts = {"ce": ce, "aux_loss": aux, "expert_load": load}
    return ce + model.config.moe.aux_loss_coef * aux, parts


def _balance(params, load, finite, config):
    """DeepSeek's auxiliary-loss-free balancing, outside the gradient: after the update, each
    layer's correction bias moves by moe.bias_update_speed toward equal expert load (this
    step's load; a dropped, non-finite step leaves it)."""
    moe = config.moe
    if moe is None or not moe.bias_update_speed or load is None:
        return params
    bias = getattr(getattr(getattr(params, "blocks", None), "mlp", None), "score_bias", None)
    if bias is None:  # not trained here (adapters only)
        return params
    moved = jnp.where(finite, balanced_bias(bias, load, moe.bias_update_speed), bias)
    return eqx.tree_at(lambda p: p.blocks.mlp.score_bias, params, moved)


def _step_count(opt_state) -> Int[Array, ""]:
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[0][1] if counts else jnp.zeros((), jnp.int32)


class TrainStep:
    """`train_step(model, opt_state, batch) -> (model, opt_state, metrics)`; see module docstring.

    Attributes:
        n_traces: how many times the step has been traced (1 after any number of steps with
            fixed shapes; more means something is recompiling it).

    Metrics (device scalars unless noted): loss (the cross entropy, or the objective's loss
    with its own metrics added: eqllm.train.objectives), grad_norm (before
    clipping), lr, update_norm, param_norm, finite (bool), grad_norm/layer (vector over layers);
    for a mixture of experts also aux_loss (the load-balancing loss, before its coefficient)
    and expert_load (layers x experts: the fraction of token assignments each expert got).
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        lr_schedule: optax.Schedule,
        *,
        grad_accum: int = 1,
        param_shardings=None,
        batch_sharding=None,
        dropout_seed: int = 0,
        pipeline: Pipeline | None = None,
        document_token: int | None = None,
        reset_positions: bool = False,
        objective=None,
    ):
        if grad_accum < 1:
            raise EqllmError(f"grad_accum={grad_accum} must be >= 1")
        if pipeline is not None and objective is not None:
            raise EqllmError(
                "a pipelined step computes the causal LM loss only; run post-training objectives "
                "with mesh.pipeline=1 and train.microbatches=1"
            )
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
        # Document masking of token windows: segments from this end-of-text id (None: off,
        # unless a batch brings its own segment ids), positions restarting per document.
        self.document_token = document_token
        self.reset_positions = reset_positions
        # What the step minimises: `objective(model, batch) -> (loss, parts)` for a batch that
        # is not (tokens, mask) (eqllm.train.objectives); None is the causal LM loss.
        self.objective = objective
        # The batch goes first so that "all-except-first" donates exactly model and opt_state.
        self._compiled = eqx.filter_jit(self._step, donate="all-except-first")

    def __call__(
        self,
        model: CausalLM,
        opt_state,
        batch: Int[Array, "batch window"]
        | Int[np.ndarray, "batch window"]
        | tuple[Int[np.ndarray, "batch window"], Bool[np.ndarray, "batch window-1"]]
        | tuple[
            Int[np.ndarray, "batch window"],
            Bool[np.ndarray, "batch window-1"],
            Int[np.ndarray, "batch window"],
        ]
        | dict,
        mask: Bool[np.ndarray, "batch window-1"] | Bool[Array, "batch window-1"] | None = None,
        segment_ids: Int[np.ndarray, "batch window"] | Int[Array, "batch window"] | None = None,
    ):
        """One step. A numpy `batch` (this process's rows) is checked on the host, with no device
        round trip, then placed by `batch_sharding`; a device array is checked on its device.
        `batch` may also be a (tokens, mask) pair, `mask` marking the targets `batch[:, 1:]` the
        loss is taken on (instruction data: the responses); no mask trains on every target.
        A (tokens, mask, segment_ids) triple, or `segment_ids`, packs documents into rows:
        one id per token, attention kept inside each (`eqllm.data.pack_examples`).
        A dict batch goes to the step's objective as it is (arrays with a leading batch axis)."""
        if isinstance(batch, dict):
            return self._compiled((self._place(batch), None, None), model, opt_state)
        if isinstance(batch, tuple):
            batch, mask, *rest = batch
            segment_ids = rest[0] if rest else segment_ids
        if batch.shape[0] % self.grad_accum:
            raise DataError(
                f"batch of {batch.shape[0]} sequences does not split into "
                f"grad_accum={self.grad_accum} equal micro-batches"
            )
        if self.pipeline is not None:
            self.pipeline.check(model.config, batch.shape[0] // self.grad_accum)
        check_token_range(batch, model.config.vocab_size)
        if mask is not None and mask.shape != (batch.shape[0], batch.shape[1] - 1):
            raise DataError(
                f"loss mask of shape {mask.shape} does not fit the batch {batch.shape}: it must "
                "be (batch, window - 1), one entry per target"
            )
        if segment_ids is not None and segment_ids.shape != batch.shape:
            raise DataError(
                f"segment ids of shape {segment_ids.shape} do not fit the batch {batch.shape}: "
                "give one id per token"
            )
        if isinstance(batch, np.ndarray):
            if self.batch_sharding is None:
                place = jnp.asarray
            else:
                place = lambda a: jax.make_array_from_process_local_data(  # noqa: E731
                    self.batch_sharding, a
                )
            batch = place(batch)
            mask = None if mask is None else place(mask)
            segment_ids = None if segment_ids is None else place(segment_ids)
        return self._compiled((batch, mask, segment_ids), model, opt_state)

    def _place(self, batch: dict) -> dict:
        """An objective's batch checked (its "tokens") and placed on the devices."""
        if batch["tokens"].shape[0] % self.grad_accum:
            raise DataError(
                f"batch of {batch['tokens'].shape[0]} rows does not split into "
                f"grad_accum={self.grad_accum} equal micro-batches"
            )
        if self.batch_sharding is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in batch.items()
        }

    def lower(
        self,
        model: CausalLM,
        opt_state,
        batch: Int[Array, "batch window"] | jax.ShapeDtypeStruct,
        segment_ids: Int[Array, "batch window"] | None = None,
    ):
        """The step lowered ahead of time (`.compile()` it; call the result like the step).

        For compile time, memory (`.compile().compiled.memory_analysis()`) and the HLO
        (`.compile().compiled.as_text()`). `model` and `opt_state` may hold
        `jax.ShapeDtypeStruct`s (nothing allocated); the result is then a plain
        `jax.stages.Lowered` (`.compile().memory_analysis()`).
        """
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model)):
            return self._compiled.lower((batch, None, segment_ids), model, opt_state)
        # Shapes only (jax.ShapeDtypeStruct leaves, with their shardings): a model too large to
        # allocate here is still compiled and measured. filter_jit would make them static.
        abstract, static = eqx.partition(
            (model, opt_state), lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )

        def step(batch, arrays):
            return self._step((batch, None, None), *eqx.combine(arrays, static))

        return jax.jit(step, donate_argnums=1).lower(batch, abstract)

    def _step(self, batch_and_mask, model, opt_state):
        self.n_traces += 1
        batch, mask, segment_ids = batch_and_mask
        if segment_ids is None and self.document_token is not None:
            segment_ids = document_segments(batch, self.document_token)
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
            # A pipeline runs its stages' layers itself, outside `run_blocks`' layer hook.
            fsdp = fsdp_gather(next(s.mesh for s in jax.tree.leaves(self.param_shardings)))

        def loss_of(p, micro):
            tokens, micro_mask, segments = micro
            positions = None
            if segments is not None:
                segments = segments[:, :-1]  # those of the inputs
                positions = document_positions(segments) if self.reset_positions else None
            m = eqx.combine(p, static)
            if self.pipeline is not None:  # refuses a mixture of experts (Pipeline.check)
                ce = self.pipeline.loss(m, tokens, micro_mask, positions, segments)
                return ce, {"ce": ce}
            m = m if fsdp is None else fsdp.outside_layers(m)
            if self.objective is not None:  # the whole batch: `tokens` holds it
                return self.objective(m, tokens)
            return training_loss(m, tokens, micro_mask, positions, segments)

        def grad_fn(p, micro):
            # FSDP: each layer's weights are gathered inside the layer loop, and the gradients
            # are reduced straight to the parameters' split placement (eqllm.sharding.fsdp).
            with each_layer(fsdp.layer) if fsdp is not None else contextlib.nullcontext():
                (loss, parts), grads = jax.value_and_grad(loss_of, has_aux=True)(p, micro)
            if shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, shardings)
            return (loss, parts), grads

        if self.grad_accum == 1:
            (loss, parts), grads = grad_fn(params, (batch, mask, segment_ids))
        else:
            # Each micro-batch's loss is its own masked mean; with a mask, micro-batches of
            # different response lengths are weighted equally (as transformers' Trainer does).
            micro = jax.tree.map(
                lambda x: x.reshape(self.grad_accum, -1, *x.shape[1:]), (batch, mask, segment_ids)
            )

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
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = eqx.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A non-finite step is dropped: keep the old parameters and optimizer state.
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_params = jax.tree.map(keep, new_params, params)
        new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        new_params = _balance(new_params, parts.get("expert_load"), finite, model.config)
        if shardings is not None:  # keep everything where it was placed
            new_params = jax.lax.with_sharding_constraint(new_params, shardings)
            new_opt_state = jax.lax.with_sharding_constraint(
                new_opt_state, shardings_like_params(new_opt_state, params, shardings)
            )
        metrics = {
            "loss": parts.pop("ce", loss),  # the cross entropy, or an objective's loss
            "grad_norm": grad_norm,
            "lr": jnp.asarray(self.lr_schedule(count), jnp.float32),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(new_params),
            "finite": finite,
            "grad_norm/layer": _layer_grad_norms(grads),
            **parts,  # a mixture of experts' aux_loss and expert_load
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
