"""Training-stability wrappers of an optimizer: skipping a spiking step and an exponential moving
average (EMA) of the weights, both kept in the optimizer state (so checkpoints hold them and a
resumed run continues bit for bit).

- `skip_spikes(inner, window, sigma)`: OLMo-core's `SkipStepOptimizer` rule. A step is not
  applied when its loss or its gradient norm (before clipping) exceeds the mean of the last
  `window` steps' values by more than `sigma` standard deviations (Bessel-corrected, as
  `torch.std_mean`). The rule acts once the window holds half its length (OLMo-core counts the
  latest value among them; here the history alone, so a deviation has two values or more).
  Every finite step's values enter the window, a skipped one's too (as OLMo-core does). On a
  skip the update is zero and the inner state (moments, step count, EMA) is left as it was, so
  the learning-rate schedule does not advance; `spikes` counts the skips.
- `weight_ema(inner, decay)`: after each applied update, ema = decay * ema + (1 - decay) *
  params (starting from the initial parameters, in float32), as Levanter's and torchtitan's EMA.

`make_optimizer` chains them as skip_spikes(weight_ema(clip -> optimizer)); with both off the
optimizer is returned unchanged, state and all.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm.lora import trainable


class SpikeState(NamedTuple):
    """The rolling window of a `skip_spikes` optimizer (a circular buffer) and its counters."""

    inner: optax.OptState
    losses: Float[Array, " window"]
    grad_norms: Float[Array, " window"]
    filled: Int[Array, ""]  # values held, at most window
    next: Int[Array, ""]  # where the next value is written
    spikes: Int[Array, ""]  # steps skipped so far
    skipped: Bool[Array, ""]  # whether the last step was skipped


class EmaState(NamedTuple):
    """An exponential moving average of the parameters beside the inner optimizer's state."""

    inner: optax.OptState
    ema: optax.Params


def _mean_std(values, filled) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean and Bessel-corrected standard deviation of the first `filled` values."""
    valid = jnp.arange(values.shape[0]) < filled
    n = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / n
    var = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0)) / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(var)


def is_spike(state: SpikeState, loss, grad_norm, sigma: float) -> Bool[Array, ""]:
    """Whether (loss, grad_norm) exceeds the window's mean by more than `sigma` standard
    deviations, in either; False until the window holds half its length (at least 2 values)."""
    active = state.filled >= max(2, state.losses.shape[0] // 2)
    spikes = []
    for values, x in ((state.losses, loss), (state.grad_norms, grad_norm)):
        mean, std = _mean_std(values, state.filled)
        spikes.append(x - mean > sigma * std)
    return active & (spikes[0] | spikes[1])


def skip_spikes(
    inner: optax.GradientTransformation, window: int, sigma: float
) -> optax.GradientTransformationExtraArgs:
    """`inner`, not applied on a step whose loss or gradient norm spikes (module docstring).

    Its update takes the step's loss as the keyword `loss`; the gradient norm is that of the
    updates it receives (the raw gradients: put it first in a chain)."""

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        empty = jnp.zeros((window,), jnp.float32)
        return SpikeState(inner.init(params), empty, empty, zero, zero, zero, jnp.zeros((), bool))

    def update(updates, state: SpikeState, params=None, *, loss, **extra):
        loss = jnp.asarray(loss, jnp.float32)
        grad_norm = optax.tree.norm(updates).astype(jnp.float32)
        spike = is_spike(state, loss, grad_norm, sigma)
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        keep = lambda new, old: jnp.where(spike, old, new)  # noqa: E731
        new_inner = jax.tree.map(keep, new_inner, state.inner)
        new_updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates)
        new_state = SpikeState(
            new_inner,
            state.losses.at[state.next].set(loss),
            state.grad_norms.at[state.next].set(grad_norm),
            jnp.minimum(state.filled + 1, window),
            (state.next + 1) % window,
            state.spikes + spike.astype(jnp.int32),
            spike,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)


def weight_ema(inner: optax.GradientTransformation, decay: float) -> optax.GradientTransformation:
    """`inner`, keeping ema = decay * ema + (1 - decay) * (params + update) in float32 (module
    docstring). Its update needs the parameters."""

    def init(params):
        return EmaState(inner.init(params), jax.tree.map(lambda p: p.astype(jnp.float32), params))

    def update(updates, state: EmaState, params=None, **extra):
        if params is None:
            raise ValueError("weight_ema needs the parameters in its update")
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        new_params = optax.apply_updates(params, new_updates)
        ema = jax.tree.map(
            lambda e, p: decay * e + (1 - decay) * p.astype(jnp.float32), state.ema, new_params
        )
        return new_updates, EmaState(new_inner, ema)

    return optax.GradientTransformationExtraArgs(init, update)


def spike_state(opt_state) -> SpikeState | None:
    """The `skip_spikes` state of an optimizer state, None without one."""
    return opt_state if isinstance(opt_state, SpikeState) else None


def ema_params(opt_state):
    """The EMA of the trainable parameters held in an optimizer state (float32), None without
    one."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, EmaState))
        if isinstance(s, EmaState)
    ]
    return found[0].ema if found else None


def ema_model(model, opt_state):
    """`model` with its trainable arrays replaced by their EMA (cast to each array's dtype);
    None when the optimizer keeps no EMA."""
    ema = ema_params(opt_state)
    if ema is None:
        return None
    params, static = eqx.partition(model, trainable(model))
    cast = jax.tree.map(lambda e, p: e.astype(p.dtype), ema, params)
    return eqx.combine(cast, static)
