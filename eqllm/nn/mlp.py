"""Position-wise feed-forward layers: the GPT-2 MLP and the gated variants.

GELU MLP (Hendrycks & Gimpel, 2016; GPT-2 uses the tanh approximation); SwiGLU and GeGLU
(Shazeer, 2020, "GLU Variants Improve Transformer").
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


class MLP(eqx.Module):
    """down(gelu(up(x))), GELU with the tanh approximation (GPT-2's `gelu_new`).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size.
        use_bias: biases on both projections.
    """

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = True,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d_model, d_ff, use_bias=use_bias, key=k1, dtype=dtype)
        self.down = eqx.nn.Linear(d_ff, d_model, use_bias=use_bias, key=k2, dtype=dtype)

    @jax.named_scope("eqllm.MLP")
    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        hidden = _gelu_tanh(jax.vmap(self.up)(x))  # (seq, d_ff)
        return jax.vmap(self.down)(hidden)


class GatedMLP(eqx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act='silu' (Llama), GeGLU with act='gelu' (Gemma).

    Arguments:
        d_model: input and output size.
        d_ff: hidden size.
        activation: 'silu' or 'gelu' (tanh approximation, as Gemma's `gelu_pytorch_tanh`).
        use_bias: biases on the three projections.
    """

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Literal["silu", "gelu"] = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: Literal["silu", "gelu"] = "silu",
        use_bias: bool = False,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if activation not in ("silu", "gelu"):
            raise ValueError(f"GatedMLP activation must be 'silu' or 'gelu', got {activation!r}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(d_model, d_ff, use_bias=use_bias, key=k1, dtype=dtype)
        self.up = eqx.nn.Linear(d_model, d_ff, use_bias=use_bias, key=k2, dtype=dtype)
        self.down = eqx.nn.Linear(d_ff, d_model, use_bias=use_bias, key=k3, dtype=dtype)
        self.activation = activation

    @jax.named_scope("eqllm.GatedMLP")
    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        act = jax.nn.silu if self.activation == "silu" else _gelu_tanh
        hidden = act(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x)  # (seq, d_ff)
        return jax.vmap(self.down)(hidden)
