"""A mixture of experts' balance terms, in one place for every objective.

- `forward(model, tokens, ...)`: the logits every objective's loss starts from, with the
  forward's balance terms: "aux_loss" (the load-balancing loss over all layers, as transformers
  adds it, or DeepSeek-V3's sequence-wise one: moe.balance_loss) and "expert_load" (per layer,
  the fraction of token assignments each expert received, counted once by each layer from the
  expert ids it routed and dispatched with, `eqllm.nn.Routing.load`: under DeepSeek's biased
  routing the experts the correction bias chose; a model that gives router logits alone, a
  second top-k over them, `eqllm.nn.expert_load` / `eqllm.nn.chosen_load`);
  with a capacity factor (moe.capacity_factor) also "moe/dropped": the fraction of token
  copies (tokens x experts per token, over every expert layer) that the dispatch dropped past
  the capacity, counted by the dispatch itself and summed over the devices.
  Every token is routed, padding included: a loss mask marks the targets that are scored, not
  tokens to leave out of the balance.
- `with_balance(model, loss, parts, balance)`: the objective's loss plus moe.aux_loss_coef times
  the auxiliary loss, the balance terms added to its metrics.
- `bias_update(params, load, finite, model)`: DeepSeek's auxiliary-loss-free balancing, applied
  by the train step after the update from the load the objective's forward measured.

A model without experts (or a module other than `CausalLM`, without `routed`) has no balance
terms: each function then leaves the loss and the parameters as they are.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eqllm.config.kinds import STACKS, stack_layers
from eqllm.nn import MoE, Routing, balance_loss, balanced_bias, chosen_load, expert_load

METRICS = ("aux_loss", "expert_load", "moe/dropped")


def forward(
    model,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, "batch seq vocab"], dict[str, Array]]:
    """(logits in fp32, balance terms: {} without experts) of `model` on `tokens`."""
    routing = getattr(model, "routing", None)  # a CausalLM: router logits and dropped copies
    if routing is not None:
        logits, routed = routing(tokens, positions, segment_ids)
        return logits, balance_terms(model, routed)
    routed = getattr(model, "routed", None)
    if routed is None:  # a module of one's own: its logits, no router
        return model(tokens), {}
    logits, router_logits = routed(tokens, positions, segment_ids)
    return logits, balance_terms(model, router_logits)


def balance_terms(model, routing: Routing | Array | None) -> dict[str, Array]:
    """{"aux_loss", "expert_load"} of one forward's `Routing` or router logits ({} for a dense
    model), and "moe/dropped" from a `Routing` under a capacity factor."""
    if routing is None:
        return {}
    router_logits = routing.logits if isinstance(routing, Routing) else routing
    moe_config = model.config.moe
    k = moe_config.experts_per_token
    moe = getattr(model, expert_stacks(model)[0]).mlp  # every expert layer routes alike
    aux = balance_loss(moe, router_logits, moe_config.balance_loss, k)
    if isinstance(routing, Routing):  # counted from the ids the layers routed with
        load = routing.load.astype(jnp.float32)
        load = load / load.sum(-1, keepdims=True)
    elif moe.plain_routing:
        load = expert_load(router_logits, k)[0]
    else:  # DeepSeek's biased choice: the experts the correction bias picked
        load = chosen_load(moe, router_logits)
    terms = {"aux_loss": aux, "expert_load": load}
    if moe_config.capacity_factor is not None and isinstance(routing, Routing):
        copies = router_logits.size // router_logits.shape[-1] * k  # every layer's copies
        terms["moe/dropped"] = routing.dropped.sum() / copies
    return terms


def with_balance(
    model, loss: Float[Array, ""], parts: dict, balance: dict
) -> tuple[Float[Array, ""], dict]:
    """`loss` plus moe.aux_loss_coef times the auxiliary loss of `balance` (the policy's own
    forward), its terms added to `parts`; as they are without experts."""
    if not balance:
        return loss, parts
    return loss + model.config.moe.aux_loss_coef * balance["aux_loss"], {**parts, **balance}


def bias_update(params, load: Array | None, finite, model):
    """DeepSeek's auxiliary-loss-free balancing, outside the gradient: after the update, each
    layer's correction bias moves by moe.bias_update_speed toward equal expert load (this
    step's `load`; a dropped, non-finite step leaves it). `params` unchanged without it."""
    config = getattr(model, "config", None)
    moe = getattr(config, "moe", None)
    if moe is None or not moe.bias_update_speed or load is None:
        return params
    fields = expert_stacks(model)
    layers = stack_layers(config)
    # `load` has a row per expert layer in layer order; each stack takes its own layers' rows.
    row = {i: j for j, i in enumerate(sorted(i for f in fields for i in layers[f]))}
    for field in fields:
        bias = getattr(getattr(getattr(params, field, None), "mlp", None), "score_bias", None)
        if bias is None:  # not trained here (adapters only)
            continue
        mine = load[np.array([row[i] for i in layers[field]])]
        moved = jnp.where(finite, balanced_bias(bias, mine, moe.bias_update_speed), bias)
        params = eqx.tree_at(lambda p, f=field: getattr(p, f).mlp.score_bias, params, moved)
    return params


def expert_stacks(model) -> list[str]:
    """The CausalLM fields whose layers hold a mixture of experts, in `STACKS` order (the main
    stack `blocks` for most mixtures; Nemotron 3's feed-forward layers, `ffn_blocks`; both of
    a hybrid whose Mamba-2 and attention layers each have experts)."""
    blocks = {f: getattr(model, f, None) for f in STACKS.values()}
    return [f for f, b in blocks.items() if isinstance(getattr(b, "mlp", None), MoE)]
