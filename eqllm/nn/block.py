"""The pre-norm residual Transformer block (GPT-2 / Llama layout; Xiong et al., 2020)."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from eqllm.nn.attention import Attention
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.mlp import MLP, GatedMLP
from eqllm.nn.norm import LayerNorm, RMSNorm


class Block(eqx.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)), on one sequence or a batch of them.

    Attributes:
        attn_norm: the norm applied before attention.
        attn: the self-attention layer.
        mlp_norm: the norm applied before the feed-forward layer.
        mlp: the feed-forward layer.
    """

    attn_norm: RMSNorm | LayerNorm
    attn: Attention
    mlp_norm: RMSNorm | LayerNorm
    mlp: MLP | GatedMLP

    @jax.named_scope("eqllm.Block")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*batch seq"] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))

    @jax.named_scope("eqllm.Block.cached")
    def cached(
        self, x: Float[Array, "seq d_model"], positions: Int[Array, " seq"], cache: KVCache
    ) -> tuple[Float[Array, "seq d_model"], KVCache]:
        """The block on a chunk of new positions, attending to `cache` (see Attention.cached)."""
        attended, cache = self.attn.cached(self.attn_norm(x), positions, cache)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), cache
