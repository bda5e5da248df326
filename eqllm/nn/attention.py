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

Llama 4 (Meta, 2025) adds chunked attention in place of a window (query p attends to the keys of
its own chunk of `chunk_size` positions, p // chunk_size), a weightless RMSNorm over each query
and key head in the rotary layers only, attention-temperature tuning of the queries in the NoPE
layers (Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention": the queries scaled by
1 + scale * log1p(floor((p + 1) / floor_scale))) and rotary pairs of adjacent dims, computed here
as the "rotate half" rotation of de-interleaved dims (queries and keys are permuted alike, so
their products, and the norms, are unchanged).

Segment ids (`segment_ids`, one int per token) mark packed documents: a query attends only to
keys of its own segment, so each document inside a packed row computes what it computes alone.
They compose with the window and the local flag (the masks are intersected).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.nn.attention_core import dot_product_attention, in_order_attention
from eqllm.nn.fused_attention import fused_attention
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.linear import Linear
from eqllm.nn.mask import attention_mask
from eqllm.nn.norm import RMSNorm
from eqllm.nn.rope import RotaryEmbedding


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
        chunk_size: attend only within chunks of this many positions (Llama 4; None: no
            chunks); a `local=False` call lifts it, as it lifts the window. Not with `kernel`.
        qk_l2: a weightless RMSNorm over each query and key head after the rotation, in the
            layers that rotate only (Llama 4's use_qk_norm), with `norm_eps`.
        interleaved: rotary pairs are adjacent dims (0, 1), (2, 3), ... (Llama 4).
        temperature: (floor_scale, attn_scale): in the layers that do not rotate, the queries
            at position p times 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) (None: off).
        v_norm: a weightless RMSNorm over each value head, with `norm_eps` (Gemma 4).
        k_eq_v: no value projection: the values are the keys' projection, before the QK-norm
            and the rotation (Gemma 4's global layers, attention_k_eq_v).
        kv_shared: no key or value projection (nor key norm): the layer attends to another
            layer's keys and values, passed to each call as `shared` (Gemma 4's
            num_kv_shared_layers; `eqllm.config.per_layer`).
    """

    q_proj: Linear
    k_proj: Linear | None  # None: the keys and values are another layer's (kv_shared)
    v_proj: Linear | None  # None: the values are the keys' projection (k_eq_v), or kv_shared
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
    chunk_size: int | None = eqx.field(static=True, default=None)
    qk_l2_eps: float | None = eqx.field(static=True, default=None)
    interleaved: bool = eqx.field(static=True, default=False)
    temperature: tuple[int, float] | None = eqx.field(static=True, default=None)
    v_norm_eps: float | None = eqx.field(static=True, default=None)

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
        chunk_size: int | None = None,
        qk_l2: bool = False,
        interleaved: bool = False,
        temperature: tuple[int, float] | None = None,
        v_norm: bool = False,
        k_eq_v: bool = False,
        kv_shared: bool = False,
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
        if kernel is not None and chunk_size is not None:
            raise ValueError(f"kernel={kernel!r} has no chunked mask (chunk_size={chunk_size})")
        if kv_shared and (not qk_norm_per_head or interleaved or qk_l2 or temperature):
            raise ValueError("kv_shared takes per-head QK-norm and rotate-half RoPE only")
        if chunk_size is not None and sliding_window is not None:
            raise ValueError(f"chunk_size={chunk_size} and sliding_window={sliding_window}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
            head_dim = d_model // n_heads
        kq, kk, kv, ko, kg = jax.random.split(key, 5)
        q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.q_proj = Linear(
            d_model, q_size, axes=("heads", "d_model"), use_bias=qkv_bias, key=kq, dtype=dtype
        )
        kv_axes = dict(axes=("kv_heads", "d_model"), use_bias=qkv_bias, dtype=dtype)
        self.k_proj = None if kv_shared else Linear(d_model, kv_size, key=kk, **kv_axes)
        no_values = k_eq_v or kv_shared
        self.v_proj = None if no_values else Linear(d_model, kv_size, key=kv, **kv_axes)
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
        self.k_norm = RMSNorm(k_dim, **norm) if qk_norm and not kv_shared else None
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
        self.chunk_size = chunk_size
        self.qk_l2_eps = norm_eps if qk_l2 else None
        self.interleaved = interleaved
        self.temperature = None if temperature is None else tuple(temperature)
        self.v_norm_eps = norm_eps if v_norm else None

    def project(
        self,
        x: Float[Array, "*batch seq d_model"],
        positions: Int[Array, "*#batch seq"],
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
        shared: tuple[Array, Array] | None = None,
    ) -> tuple[
        Float[Array, "*batch seq heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
        Float[Array, "*batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values of `x`, normalised and rotated to their positions (not
        rotated where `rotate` is False); a kv-shared layer's keys and values are `shared`, as
        its source layer's `project` returned them."""
        if self.k_proj is None:
            if shared is None:
                raise ValueError("a kv-shared attention layer needs its source's keys (shared)")
            return self._queries(x, positions, local, rotate), *shared
        rows = x.shape[:-1]
        q, k = self.q_proj(x), self.k_proj(x)
        v = k if self.v_proj is None else self.v_proj(x)
        whole = self.q_norm is not None and self.k_norm is not None and not self.qk_norm_per_head
        if whole:  # over the whole projection, before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(*rows, self.n_heads, self.head_dim)
        k = k.reshape(*rows, self.n_kv_heads, self.head_dim)
        v = v.reshape(*rows, self.n_kv_heads, self.head_dim)
        if self.v_norm_eps is not None:  # Gemma 4: a weightless RMSNorm over each value head
            v = _unit_rms(v, self.v_norm_eps)
        if self.q_norm is not None and self.k_norm is not None and not whole:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.interleaved:  # pairs (0, 1), (2, 3), ... -> halves (0, 2, ...), (1, 3, ...)
            q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
            k = jnp.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1)
        if self.rope is not None:
            q = self.rope(q, positions, local, rotate)
            k = self.rope(k, positions, local, rotate)
        rotates = self.rope is not None if rotate is None else rotate
        if self.qk_l2_eps is not None:
            q = _where(rotates, _unit_rms(q, self.qk_l2_eps), q)
            k = _where(rotates, _unit_rms(k, self.qk_l2_eps), k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            p = positions.astype(jnp.float32)
            tuned = 1.0 + attn_scale * jnp.log1p(jnp.floor((p + 1.0) / floor_scale))
            tuned = (q.astype(jnp.float32) * tuned[..., None, None]).astype(q.dtype)
            q = _where(jnp.logical_not(rotates), tuned, q)
        return q, k, v

    def _queries(self, x, positions, local, rotate):
        """A kv-shared layer's queries: per-head norm and rotation as in `project` (the other
        query transforms are refused for such a layer at construction)."""
        q = self.q_proj(x).reshape(*x.shape[:-1], self.n_heads, self.head_dim)
        q = q if self.q_norm is None else self.q_norm(q)
        return q if self.rope is None else self.rope(q, positions, local, rotate)

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
        shared: tuple[Array, Array] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Causal self-attention of `x`; `positions` default to 0..seq-1; `shared`: a kv-shared
        layer's keys and values (its source's `project`).

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
            q, k, v = self.project(x, fixed, local, rotate, shared)
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
            q, k, v = self.project(x, jnp.arange(x.shape[-2]), local, rotate, shared)
            attended = in_order_attention(
                q,
                k,
                v,
                self.sliding_window,
                local=local,
                segment_ids=segment_ids,
                chunk_size=self.chunk_size,
                **extra,
            )
            return self.output(attended, x)
        q, k, v = self.project(x, positions, local, rotate, shared)
        mask = attention_mask(
            positions,
            positions,
            self.sliding_window,
            local,
            segment_ids,
            segment_ids,
            chunk_size=self.chunk_size,
        )
        return self.output(dot_product_attention(q, k, v, mask, **extra), x)

    @jax.named_scope("eqllm.Attention.cached")
    def cached(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        cache: KVCache | None,
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
        shared: tuple[KVCache, Array, Array] | None = None,
    ) -> tuple[Float[Array, "seq d_model"], KVCache | None]:
        """Attention of a chunk of new positions to the cached past and to itself.

        Returns the output and the cache with the chunk's keys and values written in. The chunk
        may be a whole prompt (prefill) or one token (decode); padding has negative positions.
        A kv-shared layer takes `shared`: its source's cache as it was before the chunk and the
        chunk's keys and values from the source; it writes nothing (returns None for a cache).
        """
        q, k, v = self.project(x, positions, local, rotate, None if shared is None else shared[1:])
        source = cache if shared is None else shared[0]
        # Keys: the cache (strictly earlier positions) then the chunk itself. Attending before
        # writing keeps keys a ring buffer would overwrite while the chunk still needs them.
        keys = jnp.concatenate([source.k, k.astype(source.k.dtype)])
        values = jnp.concatenate([source.v, v.astype(source.v.dtype)])
        key_positions = jnp.concatenate([source.positions, positions])
        mask = attention_mask(
            positions, key_positions, self.sliding_window, local, chunk_size=self.chunk_size
        )
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        attended = dot_product_attention(
            q, keys, values, mask, scale=self.scale, softcap=self.softcap, sinks=self.sinks
        )
        written = None if shared is not None else cache.write(k, v, positions)
        return self.output(attended, x), written


def _unit_rms(x, eps: float):
    """x / rms(x) over the last axis, in fp32, cast back (a weightless RMSNorm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _where(flag, yes, no):
    """`yes` where the layer's flag holds: decided while tracing for a Python bool, else
    selected by the traced flag."""
    if isinstance(flag, bool | np.bool_):
        return yes if flag else no
    return jnp.where(flag, yes, no)
