"""The losses and loads of a mixture of experts' routing: the Switch Transformer's
load-balancing loss as transformers computes it, DeepSeek-V3's sequence-wise balance loss and
its auxiliary-loss-free bias update, and the expert loads they are made of."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

# The stacked `eqllm.nn.MoE` layers these take (a loose type: eqllm.nn.moe is not imported here).
MoE = eqx.Module


def expert_load(
    router_logits: Float[Array, "layers *rows experts"],
    top_k: int,
    mask: Bool[Array, "*rows"] | None = None,
) -> tuple[Float[Array, "layers experts"], Float[Array, "layers experts"]]:
    """Per layer: the fraction of (masked-in) token assignments each expert receives (each row
    sums to 1) and the mean router probability of each expert."""
    n_layers, n_experts = router_logits.shape[0], router_logits.shape[-1]
    logits = router_logits.reshape(n_layers, -1, n_experts).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    counts = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(-2)  # (L, T, E)
    m = jnp.ones(logits.shape[1]) if mask is None else mask.reshape(-1).astype(jnp.float32)
    rows = jnp.maximum(m.sum(), 1.0)
    assigned = jnp.einsum("lte,t->le", counts, m) / (rows * top_k)
    return assigned, jnp.einsum("lte,t->le", probs, m) / rows


def chosen_load(
    moe: MoE, router_logits: Float[Array, "layers *rows experts"]
) -> Float[Array, "layers experts"]:
    """Per layer of a stacked `moe` (arrays with a leading layers axis): the fraction of token
    assignments each expert receives under the layer's own routing (DeepSeek's correction bias
    and groups included); each row sums to 1."""
    n_experts = router_logits.shape[-1]

    def one(layer: MoE, logits):
        experts = layer.choices(logits.reshape(-1, n_experts))
        counts = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum((0, 1))
        return counts / counts.sum()

    return eqx.filter_vmap(one)(moe, router_logits)


def balanced_bias(
    bias: Float[Array, "layers experts"], load: Float[Array, "layers experts"], speed: float
) -> Float[Array, "layers experts"]:
    """Auxiliary-loss-free balancing (DeepSeek-V3 report, section 2.1.2): each expert's
    correction bias moves by `speed` toward equal load, up where the expert got less than the
    mean load, down where it got more: bias + speed * sign(mean(load) - load)."""
    step = speed * jnp.sign(load.mean(-1, keepdims=True) - load)
    return (bias + step).astype(bias.dtype)


def load_balancing_loss(
    router_logits: Float[Array, "layers *rows experts"],
    top_k: int,
    mask: Bool[Array, "*rows"] | None = None,
) -> Float[Array, ""]:
    """transformers' `load_balancing_loss_func` over the router logits of all layers together:
    E * sum_e f_e * P_e, f_e the assignments to expert e per (masked-in) token (summing to k),
    P_e its mean router probability, both over every layer's tokens. Without the coefficient."""
    assigned, probs = expert_load(router_logits, top_k, mask)
    n_experts = router_logits.shape[-1]
    # Every layer has the same tokens, so the means over all layers are means of the per-layer ones.
    return n_experts * top_k * jnp.sum(assigned.mean(0) * probs.mean(0))


def sequence_balance_loss(
    moe: MoE, router_logits: Float[Array, "layers batch seq experts"]
) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss (report, eqs. 17-20), without its coefficient:
    per sequence and layer, sum_i f_i P_i, f_i = E / (k T) times the tokens that chose expert i
    under the layer's own routing (correction bias and groups included), P_i the mean over
    the sequence of expert i's score normalised over the experts; averaged over sequences and
    layers. Equal load and equal scores give 1."""
    n_experts = router_logits.shape[-1]

    def one(layer: MoE, logits):  # (batch, seq, experts)
        batch, seq = logits.shape[:2]
        experts = layer.choices(logits.reshape(-1, n_experts)).reshape(batch, seq, -1)
        hits = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum((1, 2))  # (batch, E)
        f = hits * n_experts / (experts.shape[-1] * seq)
        logits = logits.astype(jnp.float32)
        scores = jax.nn.sigmoid(logits) if layer.scoring == "sigmoid" else jax.nn.softmax(logits)
        p = (scores / scores.sum(-1, keepdims=True)).mean(1)  # (batch, E)
        return jnp.sum(f * p, -1).mean()

    return eqx.filter_vmap(one)(moe, router_logits).mean()


def balance_loss(
    moe: MoE, router_logits: Float[Array, "layers batch seq experts"], kind: str, top_k: int
) -> Float[Array, ""]:
    """The load-balancing loss a mixture of experts trains with (`ModelConfig.moe.balance_loss`),
    without its coefficient: "switch" (`load_balancing_loss`) or "sequence"
    (`sequence_balance_loss`) over the stacked expert layers `moe`."""
    if kind == "sequence":
        return sequence_balance_loss(moe, router_logits)
    return load_balancing_loss(router_logits, top_k)
