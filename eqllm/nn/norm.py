"""RMSNorm (Zhang & Sennrich, 2019) and LayerNorm (Ba et al., 2016) over the last axis.

Both take any leading axes (a vector, a sequence, a batch). Statistics are computed in fp32
whatever the input dtype; the result is cast back.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def unit_rms(x: Float[Array, "*rows dim"], eps: float) -> Float[Array, "*rows dim"]:
    """x / rms(x) over the last axis, in fp32, cast back: a weightless RMSNorm."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def apply_norm(norm, x):
    """norm(x), or x where there is no norm (None)."""
    return x if norm is None else norm(x)


class RMSNorm(eqx.Module):
    """x / rms(x) * w, with Gemma's (1 + w) variant when `plus_one` is set.

    Arguments:
        dim: size of the normalised axis.
        eps: added to the mean square before the square root.
        plus_one: scale by (1 + weight) with weight initialised at 0 (Gemma).
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, plus_one: bool = False, dtype=jnp.float32):
        self.weight = jnp.zeros(dim, dtype) if plus_one else jnp.ones(dim, dtype)
        self.eps = eps
        self.plus_one = plus_one

    @jax.named_scope("eqllm.RMSNorm")
    def __call__(self, x: Float[Array, "*rows dim"]) -> Float[Array, "*rows dim"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.weight.astype(jnp.float32)
        if self.plus_one:
            scale = 1.0 + scale
        return (y * scale).astype(x.dtype)


class LayerNorm(eqx.Module):
    """(x - mean) / std * w + b, statistics in fp32.

    Arguments:
        dim: size of the normalised axis.
        eps: added to the variance.
        use_bias: learn an additive bias.
    """

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, use_bias: bool = True, dtype=jnp.float32):
        self.weight = jnp.ones(dim, dtype)
        self.bias = jnp.zeros(dim, dtype) if use_bias else None
        self.eps = eps

    @jax.named_scope("eqllm.LayerNorm")
    def __call__(self, x: Float[Array, "*rows dim"]) -> Float[Array, "*rows dim"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.weight.astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias.astype(jnp.float32)
        return y.astype(x.dtype)
