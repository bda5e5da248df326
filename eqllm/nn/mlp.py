"""Position-wise feed-forward layers: the GPT-2 MLP and the gated variants.

GELU MLP (Hendrycks & Gimpel, 2016; GPT-2 uses the tanh approximation, GPT-NeoX the exact erf
form), or with squared ReLU (So et al., 2021, "Primer"; Nemotron-H); SwiGLU and GeGLU
(Shazeer, 2020, "GLU Variants Improve Transformer").
"""

import functools
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqllm.nn.linear import Linear


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_grad(x):
    """d/dx gelu_tanh(x) in closed form."""
    k = jnp.asarray(math.sqrt(2 / math.pi), x.dtype)
    t = jnp.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


# Hand-written derivatives: autodiff of these element-wise formulas keeps several intermediate
# arrays of shape (seq, d_ff) per layer alive for the backward pass, and XLA's CPU backend
# fuses their gradient into the transposing copy that feeds the weight-gradient matmul, which
# runs slowly. These rules keep one (gelu) or two (gated) arrays instead.
@jax.custom_jvp
def gelu_tanh(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """GELU, tanh approximation (GPT-2's `gelu_new`), with a closed-form derivative."""
    return _gelu_tanh(x)


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return _gelu_tanh(x), _gelu_tanh_grad(x) * dx


@jax.custom_jvp
def gelu_exact(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """GELU, exact: x * Phi(x) with the erf form of Phi (GPT-NeoX's `gelu`), with a closed-form
    derivative."""
    return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = 0.5 * (1 + jax.lax.erf(x * jnp.asarray(1 / math.sqrt(2), x.dtype)))
    pdf = jnp.exp(-0.5 * x * x) * jnp.asarray(1 / math.sqrt(2 * math.pi), x.dtype)
    return jax.nn.gelu(x, approximate=False), (cdf + x * pdf) * dx


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def gated(activation: str, gate: Float[Array, "..."], up: Float[Array, "..."]):
    """act(gate) * up for act in {'silu', 'gelu'} (tanh GELU), with a closed-form derivative."""
    act = jax.nn.silu if activation == "silu" else _gelu_tanh
    return act(gate) * up


@gated.defjvp
def _gated_jvp(activation, primals, tangents):
    (g, u), (dg, du) = primals, tangents
    if activation == "silu":
        s = jax.nn.sigmoid(g)
        act, dact = g * s, s * (1 + g * (1 - s))
    else:
        act, dact = _gelu_tanh(g), _gelu_tanh_grad(g)
    return act * u, (dact * u) * dg + act * du


def clamped_swiglu(
    gate: Float[Array, "*rows d_ff"], up: Float[Array, "*rows d_ff"], *, alpha: float, limit: float
) -> Float[Array, "*rows d_ff"]:
    """gpt-oss's expert activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    g = min(gate, limit). The clamps bound the activations; the + 1 lets an expert pass its gate
    through where up is 0."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class MLP(eqx.Module):
    """down(gelu(up(x))), GELU with the tanh approximation (GPT-2's `gelu_new`) or exact; or
    down(relu(up(x))^2) (`relu2`).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size.
        use_bias: biases on both projections.
        approximate: the tanh approximation (True) or the exact erf form (False: GPT-NeoX).
        relu2: squared ReLU in place of GELU (Nemotron-H's `relu2`).
    """

    up: Linear
    down: Linear
    approximate: bool = eqx.field(static=True, default=True)
    relu2: bool = eqx.field(static=True, default=False)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = True,
        approximate: bool = True,
        relu2: bool = False,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        self.approximate = approximate
        self.relu2 = relu2
        k1, k2 = jax.random.split(key)
        self.up = Linear(
            d_model, d_ff, axes=("d_ff", "d_model"), use_bias=use_bias, key=k1, dtype=dtype
        )
        self.down = Linear(
            d_ff,
            d_model,
            axes=("d_model", "d_ff"),
            use_bias=use_bias,
            init="residual",
            key=k2,
            dtype=dtype,
        )

    @jax.named_scope("eqllm.MLP")
    def __call__(self, x: Float[Array, "*rows d_model"]) -> Float[Array, "*rows d_model"]:
        if self.relu2:
            hidden = jnp.square(jax.nn.relu(self.up(x)))  # (..., d_ff)
        else:
            act = gelu_tanh if self.approximate else gelu_exact
            hidden = act(self.up(x))  # (..., d_ff)
        return self.down(hidden)


class GatedMLP(eqx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act='silu' (Llama), GeGLU with act='gelu' (Gemma).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size.
        activation: 'silu' or 'gelu' (tanh approximation, as Gemma's `gelu_pytorch_tanh`).
        use_bias: biases on the three projections.
        multipliers: constants on the gate projection's output (before the activation) and on
            the down projection's (Falcon-H1's mlp_multipliers; 1.0: none).
    """

    gate: Linear
    up: Linear
    down: Linear
    activation: Literal["silu", "gelu"] = eqx.field(static=True)
    multipliers: tuple[float, float] = eqx.field(static=True, default=(1.0, 1.0))

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: Literal["silu", "gelu"] = "silu",
        use_bias: bool = False,
        multipliers: tuple[float, float] = (1.0, 1.0),
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if activation not in ("silu", "gelu"):
            raise ValueError(f"GatedMLP activation must be 'silu' or 'gelu', got {activation!r}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate = Linear(
            d_model, d_ff, axes=("d_ff", "d_model"), use_bias=use_bias, key=k1, dtype=dtype
        )
        self.up = Linear(
            d_model, d_ff, axes=("d_ff", "d_model"), use_bias=use_bias, key=k2, dtype=dtype
        )
        self.down = Linear(
            d_ff,
            d_model,
            axes=("d_model", "d_ff"),
            use_bias=use_bias,
            init="residual",
            key=k3,
            dtype=dtype,
        )
        self.activation = activation
        self.multipliers = tuple(float(m) for m in multipliers)

    @jax.named_scope("eqllm.GatedMLP")
    def __call__(self, x: Float[Array, "*rows d_model"]) -> Float[Array, "*rows d_model"]:
        gate_m, down_m = self.multipliers
        gate = self.gate(x) if gate_m == 1.0 else self.gate(x) * gate_m
        out = self.down(gated(self.activation, gate, self.up(x)))
        return out if down_m == 1.0 else out * down_m
