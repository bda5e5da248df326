"""AdamW with a warmup + decay schedule, global-norm clipping and weight decay on matrices only."""

from __future__ import annotations

import equinox as eqx
import jax
import optax

from eqllm.lora import trainable
from eqllm.nn import param_info
from eqllm.nn.linear import is_param_info
from eqllm.recipe import OptimSpec


def schedule(spec: OptimSpec, total_steps: int) -> optax.Schedule:
    """Learning rate per step: linear warmup to `spec.lr`, then the named decay.

    The decay ends at `spec.lr * spec.min_lr_ratio` on the last step. "wsd" (warmup-stable-decay)
    stays flat until the last `decay_fraction` of the steps, then decays linearly.
    """
    peak, floor = spec.lr, spec.lr * spec.min_lr_ratio
    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))
    rest = max(total_steps - warmup, 1)
    warm = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
    if spec.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, rest, alpha=spec.min_lr_ratio)
    elif spec.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, rest)
    elif spec.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        n_decay = max(1, round(rest * spec.decay_fraction))
        decay = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, n_decay)],
            [rest - n_decay],
        )
    if not warmup:
        return decay
    return optax.join_schedules([warm, decay], [warmup])


def decay_mask(model):
    """True for the weights the layers mark for decay (linear matrices, LoRA's A and B), False
    for norms, biases and embeddings; read from the layers' metadata (`eqllm.nn.param_info`).

    Shaped like the trainable arrays of `model` (`eqllm.lora.trainable`): None at frozen ones.
    """
    mask = jax.tree.map(lambda info: info.decay, param_info(model), is_leaf=is_param_info)
    return eqx.filter(mask, trainable(model))


def make_optimizer(spec: OptimSpec, total_steps: int, model) -> optax.GradientTransformation:
    """optax chain: clip by global norm (if clip_norm > 0) -> AdamW(schedule, masked decay).

    `model` (or `eqx.filter(model, eqx.is_inexact_array)`) fixes the weight-decay mask over its
    trainable arrays (only the adapters of a LoRA model).
    """
    adamw = optax.adamw(
        schedule(spec, total_steps),
        b1=spec.b1,
        b2=spec.b2,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        mask=decay_mask(model),
    )
    if spec.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(spec.clip_norm), adamw)
    return adamw
