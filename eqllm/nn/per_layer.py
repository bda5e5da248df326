"""Per-layer input embeddings (Gemma 3n; Gemma 4 E2B and E4B): every layer reads a small input
of its own for each token, a slice of a second embedding table mixed with a projection of the
token's embedding, and adds it to the residual stream through a gate of its hidden state.

`PerLayerInputs` computes every layer's input at once (the model's part, before the layers);
`PerLayerGate` is each block's part, after its MLP: x + norm(out(act(gate(x)) * input)).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqllm.nn.linear import Embedding, Linear
from eqllm.nn.norm import RMSNorm


class PerLayerInputs(eqx.Module):
    """Every layer's input: (norm(project(x) / sqrt(d_model)) + table[token] * sqrt(d)) / sqrt(2),
    split into `n_layers` slices of `d`.

    Arguments:
        vocab_size: rows of the table (the tokenizer's ids index it).
        d_model: the width of the token embeddings `x` it projects.
        n_layers: layers fed.
        d: numbers per token and layer.
        eps: the RMSNorm's epsilon.
    """

    embed: Embedding  # (vocab, n_layers * d): role "embedding", like the token table
    project: Linear  # d_model -> n_layers * d: role "readout" (its input grows with width)
    norm: RMSNorm  # over each layer's d numbers
    n_layers: int = eqx.field(static=True)
    d: int = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        d: int,
        *,
        eps: float = 1e-6,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        k_embed, k_proj = jax.random.split(key)
        wide = n_layers * d
        self.embed = Embedding(
            vocab_size, wide, axes=("vocab", "per_layer"), key=k_embed, dtype=dtype
        )
        self.project = Linear(d_model, wide, axes=("per_layer", "d_model"), key=k_proj, dtype=dtype)
        self.norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.n_layers = n_layers
        self.d = d

    @jax.named_scope("eqllm.PerLayerInputs")
    def __call__(
        self, tokens: Int[Array, "*batch seq"], x: Float[Array, "*batch seq d_model"]
    ) -> Float[Array, "layers *batch seq d"]:
        """The layers' inputs for `tokens`, whose (scaled) token embeddings are `x`; the layers
        axis leads, so a scan over layers takes one slice per layer."""
        split = (*tokens.shape, self.n_layers, self.d)
        table = self.embed(tokens).reshape(split)
        # the scale in the table's dtype, as transformers' scaled embedding multiplies
        table = table * jnp.asarray(math.sqrt(self.d), table.dtype)
        projected = self.project(x) * jnp.asarray(x.shape[-1] ** -0.5, x.dtype)
        mixed = (self.norm(projected.reshape(split)) + table.astype(x.dtype)) * jnp.asarray(
            2.0**-0.5, x.dtype
        )
        return jnp.moveaxis(mixed, -2, 0)  # (..., seq, layers, d) -> (layers, ..., seq, d)


class PerLayerGate(eqx.Module):
    """One block's use of its input: x + norm(out(gelu(gate(x)) * input)).

    Arguments:
        d_model: the residual width.
        d: the layer's input size.
        eps: the output norm's epsilon.
    """

    gate: Linear  # d_model -> d: role "readout"
    out: Linear  # d -> d_model: role "embedding" (its output grows with width)
    norm: RMSNorm

    def __init__(
        self, d_model: int, d: int, *, eps: float = 1e-6, key: PRNGKeyArray, dtype=jnp.float32
    ):
        k_gate, k_out = jax.random.split(key)
        self.gate = Linear(d_model, d, axes=("per_layer", "d_model"), key=k_gate, dtype=dtype)
        self.out = Linear(
            d, d_model, axes=("d_model", "per_layer"), init="residual", key=k_out, dtype=dtype
        )
        self.norm = RMSNorm(d_model, eps=eps, dtype=dtype)

    @jax.named_scope("eqllm.PerLayerGate")
    def __call__(
        self, x: Float[Array, "*batch seq d_model"], inputs: Float[Array, "*batch seq d"]
    ) -> Float[Array, "*batch seq d_model"]:
        gated = jax.nn.gelu(self.gate(x), approximate=True) * inputs.astype(x.dtype)
        return x + self.norm(self.out(gated))
