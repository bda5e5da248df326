"""Multi-head latent attention (MLA): DeepSeek-V2 (DeepSeek-AI, 2024, section 2.1) and V3.

Keys and values come from one shared latent per token: c = norm(W_dkv x) of `kv_lora_rank`
numbers, expanded per head by W_ukv into a key part without position (`qk_nope_head_dim`) and a
value (`v_head_dim`). Position enters through a separate rotary key of `qk_rope_head_dim`
numbers, computed from x and shared by every head, concatenated to each head's key; queries
have the same two parts, projected directly (`q_lora_rank` None, V2-Lite) or through a
compressed query latent with its own norm (V2, V3). The softmax scale is 1 / sqrt(qk head size)
times YaRN's mscale squared where the RoPE scaling sets `mscale_all_dim` (transformers'
`yarn_apply_mscale`).

The KV cache (`LatentCache`) holds only the latent and the rotary key: kv_lora_rank +
qk_rope_head_dim numbers per token and layer, against 2 * heads * head_dim for multi-head
attention. Decoding from it absorbs the up-projection (section 2.1.2): the query's position-free
part is multiplied by W_uk once, scored against the latents directly, and the weighted latents
are expanded by W_uv before the output projection, so a decode step never expands the cache.
`absorb=False` (or a wrapped kv_b_proj, such as a LoRA adapter) expands it instead; the values
are the same.

DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (`interleaved`, V3's
`rope_interleave`, and V2's complex rotation); since queries and keys are permuted alike, that
equals the "rotate half" rotation of the de-interleaved dims, which is how it is computed here.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.errors import EqllmError
from eqllm.nn.linear import Linear
from eqllm.nn.mask import attention_mask
from eqllm.nn.norm import RMSNorm
from eqllm.nn.rope import RotaryEmbedding


class LatentCache(eqx.Module):
    """The past of one sequence in one MLA layer: latents and rotary keys, by slot.

    Attributes:
        latent: the normalised key/value latent of each slot.
        rope_key: the rotated, head-shared key part of each slot.
        positions: the position each slot holds; negative for an empty slot.
    """

    latent: Float[Array, "slots latent"]
    rope_key: Float[Array, "slots rope"]
    positions: Int[Array, " slots"]

    @staticmethod
    def empty(slots: int, kv_lora_rank: int, rope_dim: int, dtype=jnp.float32) -> LatentCache:
        """A cache with every slot empty."""
        if slots <= 0:
            raise EqllmError(f"a latent cache needs at least one slot, got slots={slots}")
        return LatentCache(
            jnp.zeros((slots, kv_lora_rank), dtype),
            jnp.zeros((slots, rope_dim), dtype),
            jnp.full((slots,), -1, jnp.int32),
        )

    @property
    def slots(self) -> int:
        return self.positions.shape[-1]

    def write(self, latent, rope_key, positions: Int[Array, " seq"]) -> LatentCache:
        """The cache with a chunk's latents written in (as `eqllm.nn.KVCache.write`)."""
        slots = self.slots
        keep = (positions >= 0) & (positions > jnp.max(positions) - slots)
        index = jnp.where(keep, positions % slots, slots)  # out of range: dropped
        return LatentCache(
            self.latent.at[index].set(latent.astype(self.latent.dtype), mode="drop"),
            self.rope_key.at[index].set(rope_key.astype(self.rope_key.dtype), mode="drop"),
            self.positions.at[index].set(positions.astype(jnp.int32), mode="drop"),
        )


def _softmax_rows(scores, mask):
    """fp32 softmax over the last axis under `mask`; fully masked rows give zeros."""
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)


class MultiHeadLatentAttention(eqx.Module):
    """Causal multi-head latent attention over one sequence or a batch of them.

    Arguments:
        d_model: input and output size.
        n_heads: attention heads.
        kv_lora_rank: size of the shared key/value latent.
        qk_nope_head_dim: per-head key/query size without position.
        qk_rope_head_dim: per-head query size, and shared key size, that is rotated.
        v_head_dim: per-head value size.
        q_lora_rank: size of the query latent (None: queries projected directly from x).
        bias: biases on q_a_proj, kv_a_proj and o_proj (DeepSeek's attention_bias).
        rope: rotary embedding over qk_rope_head_dim dims.
        interleaved: the rotated dims come in interleaved pairs (see the module docstring).
        scale: multiplies the scores (None: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)).
        norm_eps: epsilon of the latents' RMSNorms.
        absorb: decode from the cache with the up-projections absorbed (False: expanded).
    """

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_norm: RMSNorm | None
    q_b_proj: Linear | None
    kv_a_proj: Linear
    kv_a_norm: RMSNorm
    kv_b_proj: Linear
    o_proj: Linear
    rope: RotaryEmbedding
    n_heads: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    interleaved: bool = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    absorb: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        rope: RotaryEmbedding,
        interleaved: bool = False,
        scale: float | None = None,
        norm_eps: float = 1e-6,
        absorb: bool = True,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if rope.dim != qk_rope_head_dim:
            raise ValueError(f"rope rotates {rope.dim} dims, qk_rope_head_dim={qk_rope_head_dim}")
        kq, kqa, kqb, kkva, kkvb, ko = jax.random.split(key, 6)
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        plain = dict(dtype=dtype)
        self.q_proj = self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        if q_lora_rank is None:
            self.q_proj = Linear(
                d_model, n_heads * qk_dim, axes=("heads", "d_model"), key=kq, **plain
            )
        else:
            self.q_a_proj = Linear(
                d_model, q_lora_rank, axes=(None, "d_model"), use_bias=bias, key=kqa, **plain
            )
            self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps, dtype=dtype)
            self.q_b_proj = Linear(
                q_lora_rank, n_heads * qk_dim, axes=("heads", None), key=kqb, **plain
            )
        self.kv_a_proj = Linear(
            d_model,
            kv_lora_rank + qk_rope_head_dim,
            axes=(None, "d_model"),
            use_bias=bias,
            key=kkva,
            **plain,
        )
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(
            kv_lora_rank,
            n_heads * (qk_nope_head_dim + v_head_dim),
            axes=("heads", None),
            key=kkvb,
            **plain,
        )
        self.o_proj = Linear(
            n_heads * v_head_dim,
            d_model,
            axes=("d_model", "heads"),
            use_bias=bias,
            init="residual",
            key=ko,
            **plain,
        )
        self.rope = rope
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.interleaved, self.absorb = v_head_dim, interleaved, absorb
        self.scale = qk_dim**-0.5 if scale is None else scale

    def with_absorb(self, absorb: bool) -> MultiHeadLatentAttention:
        """The same weights, decoding absorbed (True) or expanded (False)."""
        new = object.__new__(type(self))
        for name, value in vars(self).items():
            object.__setattr__(new, name, value)
        object.__setattr__(new, "absorb", absorb)
        return new

    def _rotate(self, x, positions):
        if self.interleaved:  # pairs (0, 1), (2, 3), ... -> halves (0, 2, ...), (1, 3, ...)
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return self.rope(x, positions)

    def project(
        self, x: Float[Array, "*batch seq d_model"], positions: Int[Array, "*#batch seq"]
    ) -> tuple[
        Float[Array, "*batch seq heads nope"],
        Float[Array, "*batch seq heads rope"],
        Float[Array, "*batch seq latent"],
        Float[Array, "*batch seq rope"],
    ]:
        """The query's position-free and rotated parts, the normalised latent and the rotated
        shared key."""
        rows = x.shape[:-1]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(*rows, self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        compressed = self.kv_a_proj(x)
        latent = self.kv_a_norm(compressed[..., : self.kv_lora_rank])
        k_rope = compressed[..., self.kv_lora_rank :]
        q_rope = self._rotate(q_rope, positions)
        k_rope = self._rotate(k_rope[..., None, :], positions)[..., 0, :]
        return q_nope, q_rope, latent, k_rope

    def _expanded(self, q_nope, q_rope, latent, k_rope, mask):
        """Attention with the latents expanded into per-head keys and values."""
        kv = self.kv_b_proj(latent)
        kv = kv.reshape(*kv.shape[:-1], self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        f32 = dict(preferred_element_type=jnp.float32)
        scores = jnp.einsum("...thd,...shd->...hts", q_nope, k_nope, **f32)
        scores = scores + jnp.einsum("...thr,...sr->...hts", q_rope, k_rope, **f32)
        probs = _softmax_rows(scores * self.scale, mask[..., None, :, :])
        out = jnp.einsum("...hts,...shv->...thv", probs.astype(v.dtype), v)
        return self.o_proj(out.reshape(*out.shape[:-2], -1))

    def _absorbed(self, q_nope, q_rope, latent, k_rope, mask):
        """The same attention read from the latents: W_uk folded into the query, W_uv applied
        to the weighted latents (one sequence)."""
        w = self.kv_b_proj.weight.astype(q_nope.dtype)
        w = w.reshape(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        q_latent = jnp.einsum("thd,hdc->thc", q_nope, w_uk)  # (seq, heads, latent)
        f32 = dict(preferred_element_type=jnp.float32)
        scores = jnp.einsum("thc,sc->hts", q_latent, latent, **f32)
        scores = scores + jnp.einsum("thr,sr->hts", q_rope, k_rope, **f32)
        probs = _softmax_rows(scores * self.scale, mask[None])
        weighted = jnp.einsum("hts,sc->thc", probs.astype(latent.dtype), latent)
        out = jnp.einsum("thc,hvc->thv", weighted, w_uv)  # (seq, heads, v_head_dim)
        return self.o_proj(out.reshape(out.shape[0], -1))

    @jax.named_scope("eqllm.MultiHeadLatentAttention")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*batch seq"] | None = None,
        local: Bool[Array, ""] | bool | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Causal attention of `x` (positions default to 0..seq-1; a negative one is padding);
        `segment_ids` keep it inside packed documents. `local` and `rotate` exist for the
        block's signature: MLA has no window and rotates every layer."""
        if positions is None:
            positions = jnp.arange(x.shape[-2])
        q_nope, q_rope, latent, k_rope = self.project(x, positions)
        mask = attention_mask(positions, positions, None, None, segment_ids, segment_ids)
        return self._expanded(q_nope, q_rope, latent, k_rope, mask)

    @jax.named_scope("eqllm.MultiHeadLatentAttention.cached")
    def cached(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        cache: LatentCache,
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> tuple[Float[Array, "seq d_model"], LatentCache]:
        """Attention of a chunk of new positions to the cached latents and to itself; the
        output and the cache with the chunk's latents written in."""
        q_nope, q_rope, latent, k_rope = self.project(x, positions)
        latents = jnp.concatenate([cache.latent, latent.astype(cache.latent.dtype)])
        keys = jnp.concatenate([cache.rope_key, k_rope.astype(cache.rope_key.dtype)])
        mask = attention_mask(positions, jnp.concatenate([cache.positions, positions]))
        latents, keys = latents.astype(q_nope.dtype), keys.astype(q_nope.dtype)
        absorbed = self.absorb and type(self.kv_b_proj) is Linear  # a wrapper: expand instead
        attend = self._absorbed if absorbed else self._expanded
        out = attend(q_nope, q_rope, latents, keys, mask)
        return out, cache.write(latent, k_rope, positions)
