"""What a training step minimises: one function per objective, the step and loop shared.

An objective is `loss(model, batch) -> (loss, parts)`, traced inside the compiled step
(`eqllm.train.step.TrainStep(objective=...)`); `parts` become metrics. The batch is whatever
the objective's data builds on the host (a pytree of arrays with a leading batch axis, split
into micro-batches along it):

- the default, (tokens, mask) -> next-token cross entropy (masked for instruction data), plus a
  mixture of experts' load-balancing loss (`eqllm.train.step.training_loss`).
- `Preference`: DPO, IPO or SimPO on pairs (`eqllm.data.preference`), the reference being the
  frozen starting model: under LoRA the same weights with the adapters off, computed in the
  same step; with full fine-tuning, log-probabilities computed before training and carried in
  the batch ("ref").
- `eqllm.train.grpo.Grpo`: the clipped GRPO surrogate with a k3 KL penalty on rollouts.

On a mixture of experts the preference and GRPO losses add `router_aux_loss_coef` times the
load-balancing loss of the policy's forward, as pretraining does (`with_balance`), and report
its "aux_loss" and "expert_load".

Preference losses, with pi and ref the summed log-probabilities of a response's tokens, |y|
its length, and delta = [pi(y_w) - ref(y_w)] - [pi(y_l) - ref(y_l)]:

- dpo (Rafailov et al., 2023; label smoothing eps is conservative DPO):
  `-(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)`
- ipo (Azar et al., 2023, length-normalised as TRL computes it):
  `(delta_w / |y_w| - delta_l / |y_l| - 1 / (2 beta))^2` with delta_* the log-ratios
- simpo (Meng et al., 2024; no reference):
  `-(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)`,
  `m = pi(y_w) / |y_w| - pi(y_l) / |y_l| - gamma / beta`
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm import lora
from eqllm.model import CausalLM
from eqllm.nn import balance_loss, expert_load

PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")


def routed_logps(
    model: CausalLM, tokens: Int[Array, "batch window"], temperature: float = 1.0
) -> tuple[Float[Array, "batch window-1"], dict[str, Array]]:
    """`token_logps` and, for a mixture of experts, the forward's load balance: {"aux_loss"
    (the load-balancing loss over all layers, before its coefficient), "expert_load"}; {} for
    a dense model. Every token is routed, padding included, as in pretraining."""
    logits, router_logits = model.routed(tokens[:, :-1])  # (batch, seq, vocab), fp32
    if temperature != 1.0:
        logits = logits / temperature
    logps = -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    if router_logits is None:
        return logps, {}
    k = model.config.moe.experts_per_token
    balance = {
        "aux_loss": balance_loss(model.blocks.mlp, router_logits, model.config.moe.balance_loss, k),
        "expert_load": expert_load(router_logits, k)[0],
    }
    return logps, balance


def token_logps(
    model: CausalLM, tokens: Int[Array, "batch window"], temperature: float = 1.0
) -> Float[Array, "batch window-1"]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) in fp32: the training forward's numbers.
    With `temperature`, those of the distribution sampling draws from: softmax(logits / T)."""
    return routed_logps(model, tokens, temperature)[0]


def with_balance(
    model: CausalLM, loss: Float[Array, ""], parts: dict, balance: dict
) -> tuple[Float[Array, ""], dict]:
    """A mixture of experts' objective: `loss` plus `router_aux_loss_coef` times the
    load-balancing loss of the policy's forward (as pretraining adds it), its parts added."""
    if not balance:
        return loss, parts
    return loss + model.config.moe.aux_loss_coef * balance["aux_loss"], {**parts, **balance}


def sequence_logps(
    model: CausalLM, tokens: Int[Array, "batch window"], mask: Bool[Array, "batch window-1"]
) -> Float[Array, " batch"]:
    """Summed log-probabilities of each row's masked-in targets (its response)."""
    return jnp.sum(jnp.where(mask, token_logps(model, tokens), 0.0), axis=-1)


reference_logps = eqx.filter_jit(sequence_logps)  # before training, for full fine-tuning


def preference_loss(
    kind: str,
    policy: Float[Array, "batch 2"],
    reference: Float[Array, "batch 2"] | None,
    lengths: Float[Array, "batch 2"],
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The mean loss over pairs and its metrics, from summed response log-probabilities.

    Arguments:
        kind: "dpo", "ipo" or "simpo" (see the module docstring).
        policy: [pairs, 2] log-probabilities of (chosen, rejected) under the model trained.
        reference: the same under the reference (None for simpo).
        lengths: [pairs, 2] response lengths in tokens.
        beta, label_smoothing, gamma: the losses' settings.

    Metrics: rewards_chosen / rewards_rejected (the mean implicit rewards: beta times the
    log-ratio, or for simpo beta times the mean log-probability), reward_margin (their mean
    difference), preference_accuracy (the share of pairs whose chosen reward is higher).
    """
    lengths = jnp.maximum(lengths, 1.0)
    if kind == "simpo":
        rewards = beta * policy / lengths
        margin = policy[:, 0] / lengths[:, 0] - policy[:, 1] / lengths[:, 1] - gamma / beta
        losses = _smoothed(beta * margin, label_smoothing)
    else:
        ratios = policy - reference
        rewards = beta * ratios
        if kind == "dpo":
            losses = _smoothed(beta * (ratios[:, 0] - ratios[:, 1]), label_smoothing)
        elif kind == "ipo":
            avg = ratios / lengths
            losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss {kind!r}; one of {PREFERENCE_LOSSES}")
    rewards = jax.lax.stop_gradient(rewards)
    parts = {
        "rewards_chosen": rewards[:, 0].mean(),
        "rewards_rejected": rewards[:, 1].mean(),
        "reward_margin": (rewards[:, 0] - rewards[:, 1]).mean(),
        "preference_accuracy": (rewards[:, 0] > rewards[:, 1]).mean(),
    }
    return losses.mean(), parts


def _smoothed(logits: Float[Array, " batch"], eps: float) -> Float[Array, " batch"]:
    return -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


@dataclass(frozen=True)
class Preference:
    """The preference objective for the step: batch {"tokens" [pairs, 2, window], "mask"
    [pairs, 2, window - 1], optional "ref" [pairs, 2]} -> (loss, metrics).

    Without "ref" in the batch the reference is `model` with its LoRA adapters off (the same
    arrays: no second copy), under stop_gradient; simpo has none.
    """

    kind: str
    beta: float
    label_smoothing: float = 0.0
    gamma: float = 0.0

    def scores(self, model: CausalLM, batch) -> tuple[Array, Array | None, Array, dict]:
        """(policy, reference, lengths), each [pairs, 2], and the policy forward's load
        balance (`routed_logps`: {} for a dense model)."""
        tokens, mask = batch["tokens"], batch["mask"]
        pairs = tokens.shape[0]
        flat_tokens = tokens.reshape(2 * pairs, -1)  # chosen and rejected of a pair side by side
        flat_mask = mask.reshape(2 * pairs, -1)
        logps, balance = routed_logps(model, flat_tokens)
        policy = jnp.sum(jnp.where(flat_mask, logps, 0.0), axis=-1).reshape(pairs, 2)
        lengths = mask.sum(-1).astype(jnp.float32)
        if self.kind == "simpo":
            return policy, None, lengths, balance
        if "ref" in batch:
            return policy, batch["ref"], lengths, balance
        if not lora.adapters(model):
            raise ValueError("a preference batch without 'ref' needs a model with LoRA adapters")
        base = lora.disabled(model)
        ref = jax.lax.stop_gradient(sequence_logps(base, flat_tokens, flat_mask).reshape(pairs, 2))
        return policy, ref, lengths, balance

    def __call__(self, model: CausalLM, batch) -> tuple[Float[Array, ""], dict[str, Array]]:
        """The loss (plus a mixture of experts' load-balancing term) and its metrics."""
        policy, ref, lengths, balance = self.scores(model, batch)
        loss, parts = preference_loss(
            self.kind,
            policy,
            ref,
            lengths,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            gamma=self.gamma,
        )
        return with_balance(model, loss, parts, balance)


@eqx.filter_jit
def preference_eval(objective: Preference, model: CausalLM, batch) -> dict[str, Array]:
    """Per pair ([pairs] each), without a gradient: the objective's loss and metrics."""
    policy, ref, lengths, _ = objective.scores(model, batch)
    ref = jnp.zeros_like(policy) if ref is None else ref  # simpo reads no reference

    def one(p, r, n):
        loss, parts = preference_loss(
            objective.kind,
            p[None],
            r[None],
            n[None],
            beta=objective.beta,
            label_smoothing=objective.label_smoothing,
            gamma=objective.gamma,
        )
        return {"loss": loss, **parts}

    return jax.vmap(one)(policy, ref, lengths)
