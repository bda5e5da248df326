"""The recipe's [optim] section: which optimizer, its schedule, clipping and the fields that
only some optimizers read (a section like those of `eqllm.recipe.sections`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Literal

from pydantic import Field

from eqllm.config import show
from eqllm.recipe.errors import RecipeError
from eqllm.recipe.sections import Count, Float, Fraction, Positive, section

Schedule = Literal["cosine", "linear", "constant", "wsd"]
OptimizerName = Literal["adamw", "muon", "soap", "lion", "adafactor"]
# The OptimSpec fields that only some optimizers read (`OptimSpec.__post_init__`).
_OPTIMIZER_FIELDS = {
    "b1": ("adamw", "muon", "soap", "lion"),
    "b2": ("adamw", "muon", "soap", "lion"),
    "eps": ("adamw", "muon", "soap"),
    "muon_momentum": ("muon",),
    "muon_ns_steps": ("muon",),
    "muon_scale": ("muon",),
    "soap_precondition_frequency": ("soap",),
    "soap_shampoo_beta": ("soap",),
    "soap_max_precond_dim": ("soap",),
    "adafactor_decay_rate": ("adafactor",),
    "adafactor_min_dim": ("adafactor",),
}


@typing.no_type_check  # pydantic checks the fields
@section
class OptimSpec:
    """The optimizer, its learning-rate schedule and global-norm clipping.

    name: "adamw" (optax.adamw), "muon" (optax.contrib.muon on the hidden matrices, AdamW on
        the rest), "soap" (`eqllm.train.soap`: Adam in the eigenbasis of Shampoo's
        preconditioners), "lion" (optax.lion) or "adafactor" (optax.adafactor). The schedule,
        the clipping and the weight-decay mask apply to each of them alike; muP's hidden
        learning-rate factor follows how each sizes its step (lr / m for AdamW, Lion and SOAP,
        lr / sqrt(m) for Adafactor and for Muon's matrices under "match_rms_adamw", lr under
        "original"; docs/scaling-laws.md); weight decay is multiplied by the learning rate for
        all five.
    schedule: "cosine" (warmup, then cosine to lr * min_lr_ratio), "linear" (warmup, then linear
        decay), "constant" (warmup, then flat), "wsd" (warmup, flat, then linear decay over the
        last `decay_fraction` of the steps).
    weight_decay applies to Linear weights only (not to norms, biases or embeddings).
    b1, b2: the moment decay rates of AdamW (Muon's AdamW group too), SOAP and Lion.
    eps: AdamW's and SOAP's denominator term (not used by Lion or Adafactor).
    clip_norm: global gradient-norm clip; 0 disables it.
    muon_momentum, muon_ns_steps: Muon's Nesterov momentum and its Newton-Schulz iterations.
    muon_scale: the factor on each orthogonalised update of a (fan_out, fan_in) matrix,
        named like torch.optim.Muon's `adjust_lr_fn`: "match_rms_adamw" (0.2 *
        sqrt(max(fan_in, fan_out)), Moonshot's rule: updates as large as AdamW's, so one `lr`
        serves both groups) or "original" (sqrt(max(1, fan_out / fan_in)), Keller Jordan's;
        wants a larger lr than AdamW).
        Muon takes the hidden matrices: weights whose last two logical axes both grow with the
        width (`eqllm.nn.ParamInfo.role` "hidden") and that have no expert axis; any leading
        axis (the stacked layers of a scanned stack) is a batch axis, each matrix
        orthogonalised on its own. Embeddings, norms, biases, the LM head, routers, stacked
        experts and MLA's latent projections (one axis a fixed rank) take AdamW with this
        section's b1, b2, eps and weight decay. With finetune.method "lora" Muon is refused
        (the adapters' matrices each have a rank axis: Muon would take none of them).
    soap_precondition_frequency: SOAP refreshes its eigenbases every this many steps (one power
        iteration and a QR; the reference's default 10).
    soap_shampoo_beta: the decay of SOAP's Shampoo statistics G G^T and G^T G.
    soap_max_precond_dim: a matrix side longer than this keeps the identity basis (the
        reference's 10000 leaves a vocabulary axis out). SOAP takes every Linear, expert and
        embedding weight as a matrix (each matrix of a stack on its own) and biases and norms
        as Adam; with finetune.method "lora" it preconditions the adapters' matrices.
    adafactor_decay_rate: Adafactor's second-moment decay exponent (beta2 = 1 - step^-rate).
    adafactor_min_dim: Adafactor factors a matrix's second moment only when both of its last
        two dimensions are at least this large. Adafactor scales each update by the
        parameter's RMS (optax's multiply_by_parameter_scale), so `lr` is a relative step.
    A field of one optimizer (muon_*, soap_*, adafactor_*, or b1 / b2 / eps where they are not used)
    set away from its default under another name is an error.

    Stability (all off by default; `eqllm.train.stability`):
    z_loss: adds z_loss * mean(logsumexp(logits)^2) over the scored tokens to the loss (PaLM's
        auxiliary z-loss, 1e-4 there); the language-model objectives only (lm, sft).
    skip_spike_window, skip_spike_sigma: a step whose loss or gradient norm exceeds the mean of
        the last skip_spike_window steps' by more than skip_spike_sigma standard deviations is
        not applied (OLMo-core's rule; 128 and 6 there); 0 turns it off.
    ema: the decay of an exponential moving average of the weights kept beside them (0: off;
        0.999 is usual), evaluated beside the raw weights and saved with the run.
    """

    name: OptimizerName = "adamw"
    lr: Annotated[Float, Field(gt=0)] = 3e-4
    min_lr_ratio: Annotated[Float, Field(ge=0, le=1)] = 0.1
    warmup_steps: Count = 100
    schedule: Schedule = "cosine"
    decay_fraction: Annotated[Float, Field(gt=0, le=1)] = 0.2
    weight_decay: Annotated[Float, Field(ge=0)] = 0.1
    b1: Fraction = 0.9
    b2: Fraction = 0.95
    eps: Annotated[Float, Field(gt=0)] = 1e-8
    clip_norm: Annotated[Float, Field(ge=0)] = 1.0
    muon_momentum: Fraction = 0.95
    muon_ns_steps: Positive = 5
    muon_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    soap_precondition_frequency: Positive = 10
    soap_shampoo_beta: Fraction = 0.95
    soap_max_precond_dim: Positive = 10000
    adafactor_decay_rate: Annotated[Float, Field(gt=0, le=1)] = 0.8
    adafactor_min_dim: Positive = 128
    z_loss: Annotated[Float, Field(ge=0)] = 0.0
    skip_spike_window: Count = 0
    skip_spike_sigma: Annotated[Float, Field(gt=0)] = 6.0
    ema: Fraction = 0.0

    def __post_init__(self) -> None:
        if 0 < self.skip_spike_window < 4:
            raise RecipeError(
                f"optim.skip_spike_window={self.skip_spike_window} is too short for a mean and a "
                "standard deviation; use 0 (off) or at least 4 (128 is usual)"
            )
        if not self.skip_spike_window and self.skip_spike_sigma != 6.0:
            raise RecipeError(
                f"optim.skip_spike_sigma={show(self.skip_spike_sigma)} has no effect with "
                "optim.skip_spike_window=0; set optim.skip_spike_window (128 is usual)"
            )
        for field in dataclasses.fields(self):
            users = _OPTIMIZER_FIELDS.get(field.name)
            value = getattr(self, field.name)
            if users is None or self.name in users or value == field.default:
                continue
            names = " or ".join(f'"{u}"' for u in users)
            raise RecipeError(
                f'optim.{field.name}={show(value)} is not used by optim.name="{self.name}" '
                f"(only by {names}); remove optim.{field.name} or set optim.name to {names}"
            )
