"""AdamW with a warmup + decay schedule, global-norm clipping and weight decay on matrices only."""

from __future__ import annotations

import equinox as eqx
import jax
import optax

from eqllm import parametrization
from eqllm.lora import trainable
from eqllm.model import CausalLM
from eqllm.nn import param_info
from eqllm.nn.linear import is_param_info
from eqllm.parametrization import Multipliers, Scales, role_multipliers, roles
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


def parameter_groups(
    model, scales: Scales | None = None
) -> tuple[object, dict[str, Multipliers]] | None:
    """(a role label at every trainable array, the factors of each role) under muP or
    CompleteP; None under SP, at the base size (every factor 1: the plain AdamW, so the update
    is SP's bit for bit; separate AdamWs per group fuse differently and drift by an ulp).

    `scales` (`eqllm.parametrization.Scales.of`) gives the parametrization of any tree of
    eqllm layers; None takes a `CausalLM`'s from its config, and SP for any other tree."""
    if scales is None:
        if not isinstance(model, CausalLM):
            return None
        scales = parametrization.scales(model.config)
    if scales.kind == "sp":
        return None
    labels = eqx.filter(roles(model), trainable(model))
    found = sorted(set(jax.tree.leaves(labels)))
    factors = {role: role_multipliers(scales, role) for role in found}
    if all(f == Multipliers() for f in factors.values()):
        return None
    return labels, factors


def make_optimizer(
    spec: OptimSpec, total_steps: int, model, *, scales: Scales | None = None
) -> optax.GradientTransformation:
    """optax chain: clip by global norm (if clip_norm > 0) -> AdamW(schedule, masked decay).

    `model` (or `eqx.filter(model, eqx.is_inexact_array)`; any tree of eqllm layers) fixes the
    weight-decay mask over its trainable arrays (only the adapters of a LoRA model).

    Under muP / CompleteP (`eqllm.parametrization`: a `CausalLM`'s config, or `scales` for any
    tree) each role gets its own AdamW, with the learning rate, eps and weight decay multiplied
    by the role's factors; `spec.lr` is then the base model's learning rate.
    """
    groups = parameter_groups(model, scales)
    lr = schedule(spec, total_steps)
    if groups is None:
        adamw = optax.adamw(
            lr,
            b1=spec.b1,
            b2=spec.b2,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            mask=decay_mask(model),
        )
    else:
        labels, factors = groups
        adamw = optax.multi_transform(
            {
                role: optax.adamw(
                    lambda step, f=f.lr: lr(step) * f,
                    b1=spec.b1,
                    b2=spec.b2,
                    eps=spec.eps * f.eps,
                    weight_decay=spec.weight_decay * f.decay,
                    mask=decay_mask(model),
                )
                for role, f in factors.items()
            },
            lambda params: labels,  # a function: a model (the labels' tree) is itself callable
        )
    if spec.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(spec.clip_norm), adamw)
    return adamw
