"""AdamW, Muon, SOAP, Lion or Adafactor with a warmup + decay schedule, global-norm clipping and
weight decay on matrices only; parameter groups and muP factors from the layers' metadata; the
optional stability wrappers (weight EMA, spike skipping) around them."""

from __future__ import annotations

import equinox as eqx
import jax
import optax
from optax.contrib import MuonDimensionNumbers

from eqllm import parametrization
from eqllm.lora import trainable
from eqllm.model import CausalLM
from eqllm.nn import param_info
from eqllm.nn.params import ParamInfo, is_param_info
from eqllm.parametrization import Multipliers, Scales, role_multipliers, roles
from eqllm.recipe import OptimSpec
from eqllm.train.soap import soap
from eqllm.train.stability import skip_spikes, weight_ema


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
    model, scales: Scales | None = None, update: str = "adam"
) -> tuple[object, dict[str, Multipliers]] | None:
    """(a role label at every trainable array, the factors of each role) under muP or
    CompleteP; None under SP, at the base size (every factor 1: the plain AdamW, so the update
    is SP's bit for bit; separate AdamWs per group fuse differently and drift by an ulp).

    `scales` (`eqllm.parametrization.Scales.of`) gives the parametrization of any tree of
    eqllm layers; None takes a `CausalLM`'s from its config, and SP for any other tree.
    `update` names how the optimizer sizes its steps (`eqllm.parametrization.UPDATE_KINDS`)."""
    if scales is None:
        if not isinstance(model, CausalLM):
            return None
        scales = parametrization.scales(model.config)
    if scales.kind == "sp":
        return None
    labels = eqx.filter(roles(model), trainable(model))
    found = sorted(set(jax.tree.leaves(labels)))
    factors = {role: role_multipliers(scales, role, update) for role in found}
    if all(f == Multipliers() for f in factors.values()):
        return None
    return labels, factors


def muon_update(spec: OptimSpec) -> str:
    """How Muon sizes a hidden matrix's step under `spec.muon_scale`
    (`eqllm.parametrization.UPDATE_KINDS`): its muP learning-rate factor follows."""
    return "spectral_rms" if spec.muon_scale == "match_rms_adamw" else "spectral"


# Muon's view of a weight stored (..., fan_out, fan_in): optax's MuonDimensionNumbers name the
# (reduction, output) axes of x @ W, so the input axis is -1 and the output axis -2; every other
# axis (the leading `layers` axis of a scanned stack) is a batch axis, orthogonalised apart.
MUON_AXES = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)


def is_muon_matrix(info: ParamInfo) -> bool:
    """Whether Muon takes this array: a hidden matrix (both of its last two logical axes grow
    with the width) with no expert axis. Embeddings, norms, biases, the LM head, routers and
    stacked experts are not."""
    return info.role == "hidden" and "expert" not in info.axes


def muon_labels(model):
    """The label "muon" at every trainable array Muon takes (`is_muon_matrix`), "adamw" at the
    others, None at frozen ones; read from the layers' metadata (`eqllm.nn.param_info`)."""
    labels = jax.tree.map(
        lambda info: "muon" if is_muon_matrix(info) else "adamw",
        param_info(model),
        is_leaf=is_param_info,
    )
    return eqx.filter(labels, trainable(model))


def soap_matrices(model):
    """True at every trainable array SOAP preconditions as a matrix (its last two axes): the
    weights of Linear, ExpertLinear and Embedding layers (the layers give them an
    initialisation role), the embeddings and the LM head included, as the reference does;
    False at biases, norm scales and other arrays (Adam). None at frozen arrays."""
    matrices = jax.tree.map(
        lambda info: info.init in ("normal", "residual"), param_info(model), is_leaf=is_param_info
    )
    return eqx.filter(matrices, trainable(model))


def _scaled(lr: optax.Schedule, factor: float) -> optax.Schedule:
    return lambda step: lr(step) * factor


def _transform(
    spec: OptimSpec, kind: str, lr: optax.Schedule, f: Multipliers, mask, model
) -> optax.GradientTransformation:
    """One optimizer of `kind` with the role factors `f` (learning rate, eps, decay)."""
    decay = spec.weight_decay * f.decay
    if kind == "soap":
        return soap(
            lr,
            soap_matrices(model),
            b1=spec.b1,
            b2=spec.b2,
            eps=spec.eps * f.eps,
            shampoo_beta=spec.soap_shampoo_beta,
            precondition_frequency=spec.soap_precondition_frequency,
            max_precond_dim=spec.soap_max_precond_dim,
            weight_decay=decay,
            mask=mask,
        )
    if kind == "adamw":
        return optax.adamw(
            lr, b1=spec.b1, b2=spec.b2, eps=spec.eps * f.eps, weight_decay=decay, mask=mask
        )
    if kind == "muon":
        # Every array of this group is a Muon matrix, so optax's own AdamW part stays empty;
        # the other arrays take `_transform(spec, "adamw", ...)` with the decay mask.
        return optax.contrib.muon(
            lr,
            ns_steps=spec.muon_ns_steps,
            beta=spec.muon_momentum,
            weight_decay=decay,
            weight_decay_mask=mask,
            muon_weight_dimension_numbers=lambda params: jax.tree.map(lambda _: MUON_AXES, params),
            consistent_rms=0.2 if spec.muon_scale == "match_rms_adamw" else None,
        )
    if kind == "lion":
        return optax.lion(lr, b1=spec.b1, b2=spec.b2, weight_decay=decay, mask=mask)
    # optax's Adafactor subtracts rate * w after the learning rate: rate = decay * lr(step)
    # decays by lr x weight_decay, as the others do.
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=spec.adafactor_min_dim,
        decay_rate=spec.adafactor_decay_rate,
        weight_decay_rate=_scaled(lr, decay) if decay else None,
        weight_decay_mask=mask,
    )


def make_optimizer(
    spec: OptimSpec, total_steps: int, model, *, scales: Scales | None = None
) -> optax.GradientTransformation:
    """optax chain: clip by global norm (if clip_norm > 0) -> the optimizer `spec.name`
    (AdamW, Muon, SOAP, Lion or Adafactor) on the schedule, with masked weight decay.

    `model` (or `eqx.filter(model, eqx.is_inexact_array)`; any tree of eqllm layers) fixes the
    weight-decay mask over its trainable arrays (only the adapters of a LoRA model) and, for
    Muon, which arrays it takes (`muon_labels`); the others take AdamW. For SOAP it fixes which
    arrays are preconditioned as matrices (`soap_matrices`; `eqllm.train.soap`).

    Under muP / CompleteP (`eqllm.parametrization`: a `CausalLM`'s config, or `scales` for any
    tree) each role gets its own optimizer, with the learning rate, eps and weight decay
    multiplied by the role's factors; `spec.lr` is then the base model's learning rate. The
    hidden factor follows how the optimizer sizes its steps: lr / m for AdamW and Lion (and
    Muon's AdamW group), lr / sqrt(m) for Adafactor (its steps scale with the weights' RMS)
    and for Muon's matrices under "match_rms_adamw", lr for Muon under "original".

    With `spec.ema` the chain keeps an EMA of the weights, with `spec.skip_spike_window` it skips
    spiking steps (its update then takes the step's `loss=`); `eqllm.train.stability`.
    """
    groups = parameter_groups(model, scales, "relative" if spec.name == "adafactor" else "adam")
    lr = schedule(spec, total_steps)
    mask = decay_mask(model)
    if spec.name != "muon" and groups is None:
        update = _transform(spec, spec.name, lr, Multipliers(), mask, model)
    else:
        kind = "adamw" if spec.name == "muon" else spec.name
        if groups is None:
            labels = jax.tree.map(lambda _: kind, param_info(model), is_leaf=is_param_info)
            labels = eqx.filter(labels, trainable(model))
            factors = {kind: Multipliers()}
        else:
            labels, factors = groups
        if spec.name == "muon":
            # A Muon matrix is "hidden": under muP it takes the hidden role's factors for
            # Muon's own step (`muon_update`).
            is_muon = muon_labels(model)
            labels = jax.tree.map(lambda m, role: "muon" if m == "muon" else role, is_muon, labels)
            muon = Multipliers()
            if groups is not None:
                s = scales or parametrization.scales(model.config)
                muon = role_multipliers(s, "hidden", muon_update(spec))
            factors = {**factors, "muon": muon}
        found = set(jax.tree.leaves(labels))
        update = optax.multi_transform(
            {
                label: _transform(
                    spec, "muon" if label == "muon" else kind, _scaled(lr, f.lr), f, mask, model
                )
                for label, f in factors.items()
                if label in found
            },
            lambda params: labels,  # a function: a model (the labels' tree) is itself callable
        )
    if spec.clip_norm > 0:
        update = optax.chain(optax.clip_by_global_norm(spec.clip_norm), update)
    # Stability (eqllm.train.stability), off by default: the optimizer above, unchanged.
    if spec.ema:
        update = weight_ema(update, spec.ema)
    if spec.skip_spike_window:
        update = skip_spikes(update, spec.skip_spike_window, spec.skip_spike_sigma)
    return update
