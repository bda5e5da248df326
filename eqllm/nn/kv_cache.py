"""A key/value cache for incremental decoding: a fixed number of slots, written as a ring.

The cache of one layer holds `slots` keys and values and the position each slot holds (-1:
empty). A key at position p lives in slot p % slots, so a cache of `sliding_window` slots keeps
exactly the window (older keys are overwritten once they fall out of it) and a cache with as
many slots as positions never wraps. Attention reads the slot positions through
`attention_mask`, where a negative key position already means "no key here", so the cache
needs no mask of its own and the shapes never change from step to step.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqllm.errors import EqllmError


class KVCache(eqx.Module):
    """Past keys and values of one sequence in one layer (stack it for several layers).

    Attributes:
        k: keys, one row per slot.
        v: values, one row per slot.
        positions: the position each slot holds; negative for an empty slot.
    """

    k: Float[Array, "slots kv_heads head_dim"]
    v: Float[Array, "slots kv_heads head_dim"]
    positions: Int[Array, " slots"]

    @staticmethod
    def empty(slots: int, kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        """A cache with every slot empty."""
        if slots <= 0:
            raise EqllmError(f"a KV cache needs at least one slot, got slots={slots}")
        return KVCache(
            jnp.zeros((slots, kv_heads, head_dim), dtype),
            jnp.zeros((slots, kv_heads, head_dim), dtype),
            jnp.full((slots,), -1, jnp.int32),
        )

    @property
    def slots(self) -> int:
        return self.positions.shape[-1]

    def write(
        self,
        k: Float[Array, "seq kv_heads head_dim"],
        v: Float[Array, "seq kv_heads head_dim"],
        positions: Int[Array, " seq"],
    ) -> KVCache:
        """The cache with the keys/values of a chunk of contiguous positions written in.

        Entries with a negative position (padding) are dropped, and so are those older than
        the newest `slots` positions of the chunk: in a ring they would be overwritten anyway,
        and dropping them keeps every slot written at most once.
        """
        slots = self.slots
        newest = jnp.max(positions)
        keep = (positions >= 0) & (positions > newest - slots)
        index = jnp.where(keep, positions % slots, slots)  # slots is out of range: dropped
        return KVCache(
            self.k.at[index].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[index].set(v.astype(self.v.dtype), mode="drop"),
            self.positions.at[index].set(positions.astype(jnp.int32), mode="drop"),
        )
