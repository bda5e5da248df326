"""GRPO (Shao et al., 2024): group-relative advantages, a clipped surrogate and a k3 KL penalty.

For a group of G completions o_i of one prompt with rewards r_i, the advantage of every token of
o_i is `A_i = (r_i - mean(r)) / (std(r) + 1e-4)` (the group's sample standard deviation, as TRL
computes it). With rho_t = exp(log pi(o_t) - log pi_old(o_t)) (pi_old: the policy that sampled
the rollouts; rho = 1 with one inner update) and d_t = log pi_ref(o_t) - log pi(o_t):

    l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + kl_coef (exp(d_t) - d_t - 1)

(`exp(d) - d - 1` is Schulman's k3 estimator of KL(pi || pi_ref); epsilon_high > epsilon is
DAPO's asymmetric clip.) The loss averages l_t over the completion tokens:

- "sequence": each completion's mean, then the mean over completions (GRPO);
- "token": the sum over all completion tokens / their count (DAPO);
- "constant": the sum / (completions x max_new_tokens) (Dr. GRPO: no length bias).

All log-probabilities are the training forward's (`eqllm.train.objectives.token_logps`): the
sampling-time numbers differ slightly, so the ratios would not be exact. They are those of the
distribution the rollouts were sampled from, softmax(logits / temperature), as TRL computes
them: the policy, the old policy and the reference alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from eqllm.model import CausalLM
from eqllm.train.objectives import routed_logps, with_balance

NORMALIZATIONS = ("sequence", "token", "constant")


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per-completion advantages: rewards standardised within each group of `group_size`
    consecutive completions (sample std, + 1e-4 so a group of equal rewards gives zeros)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r)
    return ((r - r.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1).astype(np.float32)


def grpo_loss(
    logps: Float[Array, "batch targets"],
    old_logps: Float[Array, "batch targets"],
    ref_logps: Float[Array, "batch targets"] | None,
    advantages: Float[Array, " batch"],
    mask: Bool[Array, "batch targets"],
    *,
    epsilon: float,
    epsilon_high: float,
    kl_coef: float,
    normalization: str,
    max_new_tokens: int,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The GRPO loss of the module docstring and its metrics (kl: the masked mean of k3;
    clip_fraction: the share of completion tokens whose ratio was clipped)."""
    ratio = jnp.exp(logps - old_logps)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -jnp.minimum(ratio * a, clipped * a)
    if ref_logps is not None:
        d = ref_logps - logps
        k3 = jnp.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
    else:
        k3 = jnp.zeros_like(logps)
    m = mask.astype(jnp.float32)
    lengths = jnp.maximum(m.sum(-1), 1.0)
    if normalization == "sequence":
        loss = jnp.mean(jnp.sum(per_token * m, -1) / lengths)
    elif normalization == "token":
        loss = jnp.sum(per_token * m) / jnp.maximum(m.sum(), 1.0)
    elif normalization == "constant":
        loss = jnp.sum(per_token * m) / (m.shape[0] * max_new_tokens)
    else:
        raise ValueError(f"unknown normalization {normalization!r}; one of {NORMALIZATIONS}")
    tokens = jnp.maximum(m.sum(), 1.0)
    was_clipped = (ratio != clipped) & mask
    parts = {
        "kl": jax.lax.stop_gradient(jnp.sum(k3 * m) / tokens),
        "clip_fraction": jnp.sum(was_clipped) / tokens,
    }
    return loss, parts


@dataclass(frozen=True)
class Grpo:
    """The GRPO objective for the step: batch {"tokens" [batch, window], "mask" [batch,
    window - 1] (the completion's targets), "advantages" [batch], "rewards" [batch],
    optional "old_logps" and "ref_logps" [batch, window - 1]} -> (loss, metrics).

    Without "old_logps" (one inner update) the ratio's denominator is the current policy under
    stop_gradient: rho = 1 in value, and its gradient is that of log pi.
    """

    epsilon: float = 0.2
    epsilon_high: float = 0.2
    kl_coef: float = 0.0
    normalization: str = "sequence"
    max_new_tokens: int = 16
    temperature: float = 1.0  # the rollouts' sampling temperature

    def __call__(self, model: CausalLM, batch) -> tuple[Float[Array, ""], dict[str, Array]]:
        logps, balance = routed_logps(model, batch["tokens"], self.temperature)
        old = batch.get("old_logps", jax.lax.stop_gradient(logps))
        loss, parts = grpo_loss(
            logps,
            old,
            batch.get("ref_logps"),
            batch["advantages"],
            batch["mask"],
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            kl_coef=self.kl_coef,
            normalization=self.normalization,
            max_new_tokens=self.max_new_tokens,
        )
        parts["reward_mean"] = batch["rewards"].mean()
        parts["completion_length"] = batch["mask"].sum(-1).astype(jnp.float32).mean()
        return with_balance(model, loss, parts, balance)  # a mixture of experts' aux loss
