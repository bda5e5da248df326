"""Causal self-attention (Vaswani et al., 2017) with grouped-query heads (Ainslie et al., 2023).

One module covers multi-head (kv_heads == heads), grouped-query and multi-query (kv_heads == 1)
attention, optional q/k/v and output biases, QK-norm (RMSNorm over each head, Dehghani et al.,
2023, or over the whole projection as OLMo 2 does), rotary positions, a sliding window (Mistral;
Beltagy et al., 2020), Gemma 2's soft-capping of the scores (cap * tanh(s / cap)) and gpt-oss's
attention sinks (a learned logit per head in the softmax denominator; Xiao et al., 2023).

Masking is by positions: query i attends to key j when pos_k[j] <= pos_q[i], pos_q[i] - pos_k[j]
< window, and pos_k[j] >= 0. A negative key position marks an empty slot, which is how a KV
cache or a padded batch is expressed without another code path. Models that alternate windowed
("local") and global layers pass a per-layer `local` flag, traced inside the scan over layers:
the window then applies only where it is True. A per-layer `rotate` flag, traced the same way,
skips the rotary embedding in the layers where it is False (NoPE layers, SmolLM3).

Segment ids (`segment_ids`, one int per token) mark packed documents: a query attends only to
keys of its own segment, so each document inside a packed row computes what it computes alone.
They compose with the window and the local flag (the masks are intersected).
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.nn.fused_attention import fused_attention
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.linear import Linear
from eqllm.nn.mask import attention_mask
from eqllm.nn.norm import RMSNorm
from eqllm.nn.rope import RotaryEmbedding


def dot_product_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch kv_seq kv_heads head_dim"],
    v: Float[Array, "*batch kv_seq kv_heads head_dim"],
    mask: Bool[Array, "*#batch seq kv_seq"],
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """softmax(cap(q k^T * scale) + mask) v, query heads grouped over the shared kv heads.

    `scale` defaults to 1 / sqrt(head_dim); `softcap` (None: off) bounds the scores to
    (-softcap, softcap) by softcap * tanh(s / softcap), before the mask. `sinks` (None: none)
    are attention sinks, one learned logit per query head (gpt-oss): each joins its head's
    softmax denominator as one more key that takes probability mass and carries no value, so
    a row's weights sum to less than 1.
    `mask` broadcasts over the leading axes (one (seq, kv_seq) mask serves a whole batch).
    Scores and softmax are in fp32 whatever the input dtype. A query row with no allowed key
    returns zeros (it only occurs for padding).
    """
    *batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[-2]
    # (..., seq, kv_heads, groups, head_dim): query heads that share one kv head sit together.
    q = q.reshape(*batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("...tkgd,...skd->...kgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = mask[..., None, None, :, :]  # broadcast over (kv_heads, groups)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        # (kv_heads, groups, 1, 1): query head h = kv * groups + g, as q was reshaped above.
        sink = sinks.astype(jnp.float32).reshape(kv_heads, heads // kv_heads, 1, 1)
        top = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
        e = jnp.exp(scores - top)  # masked scores underflow to 0
        probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))
    probs = jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)  # fully masked rows -> 0
    out = jnp.einsum("...kgts,...skd->...tkgd", probs.astype(v.dtype), v)
    return out.reshape(*batch, seq, heads, head_dim)


def in_order_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    sliding_window: int | None = None,
    chunks: int = 4,
    *,
    local: Bool[Array, ""] | bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Causal attention of positions 0..seq-1, skipping key blocks the mask would zero anyway.

    The queries are split into up to `chunks` blocks of at least 64 rows; each attends only to
    the keys up to its last row (and from its window's start), so the scores computed fall from
    seq^2 to about (chunks + 1) / (2 * chunks) of it (62.5% at 4). Same values as
    `dot_product_attention` with the causal mask. With a traced `local` flag the window may be
    lifted, so only the causal skipping applies; a Python bool decides it while tracing.
    `segment_ids` (None: one segment) further keep each query to keys of its own segment;
    `sinks` as in `dot_product_attention`.
    """
    if isinstance(local, bool | np.bool_):  # known when tracing: apply or drop the window now
        sliding_window, local = (sliding_window if local else None), None
    seq = q.shape[-3]
    n = max(1, min(chunks, seq // 64))
    bounds = [seq * i // n for i in range(n + 1)]
    positions = jnp.arange(seq)
    outs = []
    for start, end in itertools.pairwise(bounds):
        windowed = sliding_window is not None and local is None
        first = max(0, start - sliding_window + 1) if windowed else 0
        mask = attention_mask(positions[start:end], positions[first:end], sliding_window, local)
        if segment_ids is not None:
            same = segment_ids[..., start:end, None] == segment_ids[..., None, first:end]
            mask = mask & same
        keys, values = k[..., first:end, :, :], v[..., first:end, :, :]
        outs.append(
            dot_product_attention(
                q[..., start:end, :, :],
                keys,
                values,
                mask,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
            )
        )
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=-3)


class Attention(eqx.Module):
    """Causal self-attention over one sequence or a batch of them (leading axes).

    Arguments:
        d_model: input and output size.
        n_heads: query heads.
        n_kv_heads: key/value heads (None: n_heads); must divide n_heads.
        head_dim: size of one head (None: d_model // n_heads).
        qkv_bias: biases on the q/k/v projections (GPT-2, Qwen2).
        out_bias: bias on the output projection (GPT-2).
        qk_norm: RMSNorm over each query and key head before the rotation.
        qk_norm_per_head: False normalises the whole q and k projections instead (OLMo 2).
        norm_plus_one: the QK-norm scales by (1 + w) (Gemma 3).
        rope: rotary embedding applied to queries and keys (None: no rotation, as with
            learned absolute positions).
        sliding_window: attend only to the last `sliding_window` positions (None: all); a
            `local=False` call lifts it for that layer.
        norm_eps: epsilon of the QK-norm.
        scale: multiplies the scores (None: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar**-0.5).
        softcap: soft-capping of the scores (None: off).
        sinks: a learned sink logit per query head in the softmax denominator (gpt-oss; see
            `dot_product_attention`), initialised to 0.
        output_gate: the heads' output times sigmoid(gate_proj(x)) before the output projection
            (gated attention: Qwen3-Next, Qwen3.5).
        kernel: None computes attention here (scores materialised, fp32 softmax); "cudnn"
            calls `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused kernel
            on a GPU with bf16/fp16 inputs ("xla": the same call, XLA's implementation). Cached
            inference (`cached`) always computes here. Not with `softcap` or `sinks`
            (`jax.nn.dot_product_attention` has no sink logits).
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    gate_proj: Linear | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rope: RotaryEmbedding | None
    sinks: Float[Array, " heads"] | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    sliding_window: int | None = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    qk_norm_per_head: bool = eqx.field(static=True)
    kernel: str | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_per_head: bool = True,
        norm_plus_one: bool = False,
        rope: RotaryEmbedding | None = None,
        sliding_window: int | None = None,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        output_gate: bool = False,
        kernel: str | None = None,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        if kernel not in (None, "xla", "cudnn"):
            raise ValueError(f"kernel={kernel!r} must be None, 'xla' or 'cudnn'")
        if kernel is not None and softcap is not None:
            raise ValueError(f"kernel={kernel!r} cannot soft-cap the scores (softcap={softcap})")
        if kernel is not None and sinks:
            raise ValueError(f"kernel={kernel!r} has no attention sinks (sinks=True)")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
            head_dim = d_model // n_heads
        kq, kk, kv, ko, kg = jax.random.split(key, 5)
        q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.q_proj = Linear(
            d_model, q_size, axes=("heads", "d_model"), use_bias=qkv_bias, key=kq, dtype=dtype
        )
        self.k_proj = Linear(
            d_model, kv_size, axes=("kv_heads", "d_model"), use_bias=qkv_bias, key=kk, dtype=dtype
        )
        self.v_proj = Linear(
            d_model, kv_size, axes=("kv_heads", "d_model"), use_bias=qkv_bias, key=kv, dtype=dtype
        )
        self.o_proj = Linear(
            q_size,
            d_model,
            axes=("d_model", "heads"),
            use_bias=out_bias,
            init="residual",
            key=ko,
            dtype=dtype,
        )
        self.gate_proj = (
            Linear(d_model, q_size, axes=("heads", "d_model"), key=kg, dtype=dtype)
            if output_gate
            else None
        )
        q_dim, k_dim = (head_dim, head_dim) if qk_norm_per_head else (q_size, kv_size)
        norm = dict(eps=norm_eps, plus_one=norm_plus_one, dtype=dtype)
        self.q_norm = RMSNorm(q_dim, **norm) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, **norm) if qk_norm else None
        self.rope = rope
        # A sink logit of 0 starts as one more key scoring 0 (transformers draws N(0, std)).
        self.sinks = jnp.zeros(n_heads, dtype) if sinks else None
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.qk_norm_per_head = qk_norm_per_head
        self.kernel = kernel

    def project(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*#batch seq"],
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> tuple[
        Float[Array, "*batch seq heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values of `x`, normalised and rotated to their positions (not
        rotated where `rotate` is False)."""
        rows = x.shape[:-1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        whole = self.q_norm is not None and self.k_norm is not None and not self.qk_norm_per_head
        if whole:  # over the whole projection, before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(*rows, self.n_heads, self.head_dim)
        k = k.reshape(*rows, self.n_kv_heads, self.head_dim)
        v = v.reshape(*rows, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not whole:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope is not None:
            q = self.rope(q, positions, local, rotate)
            k = self.rope(k, positions, local, rotate)
        return q, k, v

    def output(
        self,
        attended: Float[Array, "*batch seq heads head_dim"],
        x: Float[Array, "*batch seq d_model"] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """The output projection of the concatenated heads, gated by `x` (the layer's input)
        where the layer has an output gate."""
        heads = attended.reshape(*attended.shape[:-2], -1)
        if self.gate_proj is not None:
            gate = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
            heads = (heads.astype(jnp.float32) * gate).astype(heads.dtype)
        return self.o_proj(heads)

    @jax.named_scope("eqllm.Attention")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*batch seq"] | None = None,
        local: Bool[Array, ""] | bool | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Causal self-attention of `x`; `positions` default to 0..seq-1.

        With the default positions the causal structure is known when tracing, and key blocks
        entirely in the future are skipped (`in_order_attention`). `local` is the layer's flag
        (see the module docstring; None: the window, if any, applies). `segment_ids` (None: one
        segment) keep attention inside each packed document. `rotate` False: no rotary
        embedding in this layer (None: the layer's `rope`, if any, applies).
        """
        extra = dict(scale=self.scale, softcap=self.softcap, sinks=self.sinks)
        seq = x.shape[-2]
        # cuDNN takes an explicit mask only as a bias, which its backward pass needs at even
        # lengths; odd lengths with explicit positions (evaluation padding) stay here.
        if self.kernel is not None and (positions is None or seq % 2 == 0):
            fixed = jnp.arange(seq) if positions is None else positions
            q, k, v = self.project(x, fixed, local, rotate)
            attended = fused_attention(
                q,
                k,
                v,
                positions,
                sliding_window=self.sliding_window,
                local=local,
                scale=self.scale,
                implementation=self.kernel,
                segment_ids=segment_ids,
            )
            return self.output(attended, x)
        if positions is None:  # one row of positions serves the batch: rotations computed once
            q, k, v = self.project(x, jnp.arange(x.shape[-2]), local, rotate)
            attended = in_order_attention(
                q, k, v, self.sliding_window, local=local, segment_ids=segment_ids, **extra
            )
            return self.output(attended, x)
        q, k, v = self.project(x, positions, local, rotate)
        mask = attention_mask(
            positions, positions, self.sliding_window, local, segment_ids, segment_ids
        )
        return self.output(dot_product_attention(q, k, v, mask, **extra), x)

    @jax.named_scope("eqllm.Attention.cached")
    def cached(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        cache: KVCache,
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> tuple[Float[Array, "seq d_model"], KVCache]:
        """Attention of a chunk of new positions to the cached past and to itself.

        Returns the output and the cache with the chunk's keys and values written in. The chunk
        may be a whole prompt (prefill) or one token (decode); padding has negative positions.
        """
        q, k, v = self.project(x, positions, local, rotate)
        # Keys: the cache (strictly earlier positions) then the chunk itself. Attending before
        # writing keeps keys a ring buffer would overwrite while the chunk still needs them.
        keys = jnp.concatenate([cache.k, k.astype(cache.k.dtype)])
        values = jnp.concatenate([cache.v, v.astype(cache.v.dtype)])
        key_positions = jnp.concatenate([cache.positions, positions])
        mask = attention_mask(positions, key_positions, self.sliding_window, local)
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        attended = dot_product_attention(
            q, keys, values, mask, scale=self.scale, softcap=self.softcap, sinks=self.sinks
        )
        return self.output(attended, x), cache.write(k, v, positions)
