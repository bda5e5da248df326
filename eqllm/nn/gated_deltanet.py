"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2025): linear attention with a gated delta rule.

Each value head keeps a state S of shape (d_k, d_v). For every token, S decays by exp(g), the
value it predicts for the token's key is corrected towards the token's value with strength
beta (the delta rule), and the token's query reads it:

    S = exp(g) * S;   S = S + beta * k (v - k^T S)^T;   o = q^T S

as Qwen3-Next, Qwen3.5 and OLMo-hybrid use it (transformers' `Qwen3NextGatedDeltaNet`): q, k
and v pass a short depthwise causal convolution with SiLU, q and k are L2-normalised (q also
scaled by 1/sqrt(d_k)), g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), key heads
are shared by groups of consecutive value heads, and the output is gated by z through an
RMSNorm (norm(o) * w * silu(z)) before the output projection.

The rule has two forms with the same values: `chunked` (training and prefill, parallel within
chunks of tokens) and `recurrent` (decoding, token by token). The state a call returns (the
convolution's last inputs and S) continues the sequence in the next call, in either form.
Segment ids reset both at document boundaries, so packed documents never see each other.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.errors import EqllmError
from eqllm.nn.conv import behind_padding, causal_conv
from eqllm.nn.linear import Linear
from eqllm.nn.norm import RMSNorm


class GatedDeltaNetState(eqx.Module):
    """What a Gated DeltaNet layer carries from one call to the next (stack it for layers).

    Attributes:
        conv: the convolution's last kernel - 1 inputs (q, k, v channels, before the conv).
        recurrent: the delta-rule state S of every value head, in fp32.
    """

    conv: Float[Array, "*batch conv_width conv_dim"]
    recurrent: Float[Array, "*batch heads d_k d_v"]


def l2norm(x: Float[Array, "*rows dim"], eps: float = 1e-6) -> Float[Array, "*rows dim"]:
    """x / sqrt(sum(x^2) + eps) in fp32, the normalisation of q and k (as FLA computes it)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, state, reset):
    """fp32 inputs with key heads repeated to value heads, a zero state and no resets by default."""
    seq, key_heads, d_k = k.shape
    heads, d_v = v.shape[-2:]
    if heads % key_heads:
        raise EqllmError(f"key heads={key_heads} must divide value heads={heads}")
    q, k = (jnp.repeat(x.astype(jnp.float32), heads // key_heads, axis=1) for x in (q, k))
    v, g, beta = (x.astype(jnp.float32) for x in (v, g, beta))
    state = jnp.zeros((heads, d_k, d_v), jnp.float32) if state is None else state
    reset = jnp.zeros(seq, bool) if reset is None else reset
    return q, k, v, g, beta, state.astype(jnp.float32), reset


def recurrent(
    q: Float[Array, "seq key_heads d_k"],
    k: Float[Array, "seq key_heads d_k"],
    v: Float[Array, "seq heads d_v"],
    g: Float[Array, "seq heads"],
    beta: Float[Array, "seq heads"],
    state: Float[Array, "heads d_k d_v"] | None = None,
    *,
    reset: Bool[Array, " seq"] | None = None,
) -> tuple[Float[Array, "seq heads d_v"], Float[Array, "heads d_k d_v"]]:
    """The gated delta rule token by token (decoding one or a few tokens).

    `q` (already scaled) and `k` are normalised; each key head serves heads // key_heads
    consecutive value heads. `g` is the log decay (<= 0), `beta` the write strength. `state`
    (None: zeros) is S before the first token; `reset` (None: none) zeroes S before the tokens
    where it is True (a new document). Returns the outputs and S after the last token; the
    arithmetic is in fp32, the outputs in v's dtype.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state, reset = _prepare(q, k, v, g, beta, state, reset)

    def step(s, token):
        q_t, k_t, v_t, g_t, b_t, r_t = token
        s = jnp.where(r_t, 0.0, s) * jnp.exp(g_t)[:, None, None]
        predicted = jnp.einsum("hd,hde->he", k_t, s)
        s = s + k_t[:, :, None] * ((v_t - predicted) * b_t[:, None])[:, None, :]
        return s, jnp.einsum("hd,hde->he", q_t, s)

    state, out = jax.lax.scan(step, state, (q, k, v, g, beta, reset))
    return out.astype(out_dtype), state


def chunked(
    q: Float[Array, "seq key_heads d_k"],
    k: Float[Array, "seq key_heads d_k"],
    v: Float[Array, "seq heads d_v"],
    g: Float[Array, "seq heads"],
    beta: Float[Array, "seq heads"],
    state: Float[Array, "heads d_k d_v"] | None = None,
    *,
    chunk_size: int = 64,
    reset: Bool[Array, " seq"] | None = None,
) -> tuple[Float[Array, "seq heads d_v"], Float[Array, "heads d_k d_v"]]:
    """The gated delta rule chunk by chunk (training and prefill); same values as `recurrent`.

    Within a chunk of `chunk_size` tokens the delta-rule updates are folded into a few matrix
    products by the UT transform (the inverse of a unit lower-triangular matrix, row by row, as
    transformers' `torch_chunk_gated_delta_rule` and FLA compute it); a `lax.scan` then carries
    S across chunks. A sequence whose length is not a multiple of the chunk is padded with tokens
    that change nothing (k = v = 0, g = 0). Arguments and results as `recurrent`.

    This function is the one seam for a fused kernel: a Pallas (or Triton) implementation of
    the chunked rule with this signature can replace its body and nothing else changes.
    """
    if chunk_size < 1:
        raise EqllmError(f"chunk_size={chunk_size} must be at least 1")
    out_dtype = v.dtype
    seq = v.shape[0]
    q, k, v, g, beta, state, reset = _prepare(q, k, v, g, beta, state, reset)
    pad = -seq % chunk_size
    n = (seq + pad) // chunk_size

    def chunks(x):  # (seq, heads, ...) -> (chunks, heads, chunk, ...)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.swapaxes(x.reshape(n, chunk_size, *x.shape[1:]), 1, 2)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    # Documents inside a chunk: token i sees token j <= i only when no reset lies in (j, i],
    # and reads the state carried in only when no reset lies in [start, i].
    doc = jnp.cumsum(jnp.pad(reset, (0, pad)).reshape(n, chunk_size), axis=1)  # (n, chunk)
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    same = (doc[:, :, None] == doc[:, None, :]) & causal  # (n, chunk, chunk)
    carry = (doc == 0).astype(jnp.float32)  # (n, chunk)
    cum = jnp.cumsum(g, axis=-1)  # (n, heads, chunk): log decay from the chunk's start
    # exp(cum_i - cum_j) for the pairs that see each other, 0 elsewhere (the inner where keeps
    # exp of the masked, positive differences from overflowing in the gradient).
    visible = same[:, None]
    between = jnp.where(visible, cum[..., :, None] - cum[..., None, :], 0)
    decay = jnp.where(visible, jnp.exp(between), 0)  # (n, heads, chunk, chunk)
    k_beta = k * beta[..., None]
    # UT transform: (I + strictly_lower(k_beta k^T * decay)) u = v * beta, and w likewise for
    # the keys decayed from the chunk's start; v - w S is then what each token writes.
    system = jnp.einsum("nhid,nhjd->nhij", k_beta, k) * decay
    inverse = unit_lower_inverse(jnp.tril(system, -1))
    from_start = jnp.exp(cum) * carry[:, None]  # (n, heads, chunk)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k_beta * from_start[..., None])
    attn = jnp.einsum("nhid,nhjd->nhij", q, k) * decay  # within the chunk, diagonal included
    q_start = q * from_start[..., None]
    # Keys decayed to the chunk's end (only the last document's tokens reach the state).
    to_end = jnp.where(same[:, None, -1, :], jnp.exp(jnp.minimum(cum[..., -1:] - cum, 0)), 0)
    k_end = k * to_end[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * carry[:, None, -1]  # (n, heads)

    def step(s, c):
        u_c, w_c, attn_c, q_c, k_c, decay_c = c
        written = u_c - jnp.einsum("hcd,hde->hce", w_c, s)
        out = jnp.einsum("hcd,hde->hce", q_c, s) + jnp.einsum("hij,hje->hie", attn_c, written)
        s = s * decay_c[:, None, None] + jnp.einsum("hcd,hce->hde", k_c, written)
        return s, out

    state, out = jax.lax.scan(step, state, (u, w, attn, q_start, k_end, chunk_decay))
    # (chunks, heads, chunk, d_v) -> (chunks, chunk, heads, d_v) -> (seq, heads, d_v)
    out = jnp.swapaxes(out, 1, 2).reshape(n * chunk_size, *out.shape[1:2], out.shape[-1])
    return out[:seq].astype(out_dtype), state


def unit_lower_inverse(lower: Float[Array, "*rows n n"]) -> Float[Array, "*rows n n"]:
    """(I + lower)^-1 for a strictly lower triangular `lower`, by forward substitution one row
    at a time (as transformers' `torch_chunk_gated_delta_rule` and FLA compute it).

    Matrix products and a `fori_loop` only. `lax.linalg.triangular_solve` (LAPACK on CPU) left
    the qwen3_5-nano training step waiting forever after a few dozen steps, every thread idle,
    and the step ran ~10x slower with it (~350 against ~3,400 tokens/s, 2-core CPU).
    """
    n = lower.shape[-1]
    cols = jnp.arange(n)

    def row(i, a):  # a[i, :i] += a[i, :i] @ a[:i, :i], rows above i already final
        update = jnp.einsum("...k,...kj->...j", a[..., i, :], a)
        return a.at[..., i, :].add(jnp.where(cols < i, update, 0))

    return jax.lax.fori_loop(1, n, row, -lower) + jnp.eye(n, dtype=lower.dtype)


class GatedDeltaNet(eqx.Module):
    """A Gated DeltaNet token mixer over one sequence or a batch of them (leading axes).

    Arguments:
        d_model: input and output size.
        n_key_heads: query/key heads.
        n_value_heads: value heads, a multiple of `n_key_heads` (each key head serves a group
            of consecutive value heads).
        key_head_dim: size of a query/key head (d_k).
        value_head_dim: size of a value head (d_v).
        conv_kernel: width of the causal convolution over q, k and v.
        norm_eps: epsilon of the gated RMSNorm on the output.
        chunk_size: tokens per chunk of the chunked form.
        allow_neg_eigval: beta = 2 * sigmoid(b), in (0, 2) (OLMo-hybrid's option).

    The projections are separate `Linear` layers (q, k, v, z, b, a, out): Qwen3.5 stores
    `in_proj_qkv` (q, k, v stacked), `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next fuses
    `in_proj_qkvz` and `in_proj_ba` interleaved per key head; OLMo-hybrid keeps them apart.
    Each is a split of rows into these, and adapters and sharding see one matrix per role.
    `conv_weight` is torch's `conv1d.weight` without its middle axis, channels in the order
    q, k, v (all three checkpoints store it so), so it imports as it is.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    z_proj: Linear
    b_proj: Linear
    a_proj: Linear
    out_proj: Linear
    conv_weight: Float[Array, "conv_dim kernel"]
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, " heads"]
    norm: RMSNorm
    n_key_heads: int = eqx.field(static=True)
    n_value_heads: int = eqx.field(static=True)
    key_head_dim: int = eqx.field(static=True)
    value_head_dim: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    allow_neg_eigval: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_key_heads: int,
        n_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
        allow_neg_eigval: bool = False,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if n_value_heads % n_key_heads:
            raise EqllmError(f"n_key_heads={n_key_heads} must divide n_value_heads={n_value_heads}")
        for name, value in (("conv_kernel", conv_kernel), ("chunk_size", chunk_size)):
            if value < 1:
                raise EqllmError(f"{name}={value} must be at least 1")
        keys = jax.random.split(key, 9)
        key_dim, value_dim = n_key_heads * key_head_dim, n_value_heads * value_head_dim

        def linear(i, n_out, axes, init="normal", n_in=d_model):
            return Linear(n_in, n_out, axes=axes, init=init, key=keys[i], dtype=dtype)

        self.q_proj = linear(0, key_dim, ("kv_heads", "d_model"))
        self.k_proj = linear(1, key_dim, ("kv_heads", "d_model"))
        self.v_proj = linear(2, value_dim, ("heads", "d_model"))
        self.z_proj = linear(3, value_dim, ("heads", "d_model"))
        self.b_proj = linear(4, n_value_heads, ("heads", "d_model"))
        self.a_proj = linear(5, n_value_heads, ("heads", "d_model"))
        self.out_proj = linear(6, d_model, ("d_model", "heads"), "residual", value_dim)
        # torch's Conv1d default: uniform within 1/sqrt(fan_in), fan_in being the kernel width.
        bound = conv_kernel**-0.5
        shape = (2 * key_dim + value_dim, conv_kernel)
        self.conv_weight = jax.random.uniform(keys[7], shape, dtype, -bound, bound)
        # As transformers initialises them: A in (0.01, 16), so heads decay fast to slow; dt_bias 1.
        self.A_log = jnp.log(jax.random.uniform(keys[8], (n_value_heads,), dtype, 0.01, 16.0))
        self.dt_bias = jnp.ones(n_value_heads, dtype)
        self.norm = RMSNorm(value_head_dim, eps=norm_eps, dtype=dtype)
        self.n_key_heads = n_key_heads
        self.n_value_heads = n_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.chunk_size = chunk_size
        self.allow_neg_eigval = allow_neg_eigval

    def init_state(self, batch: tuple[int, ...] = (), dtype=jnp.float32) -> GatedDeltaNetState:
        """The state before a sequence's first token: zeros, for `batch` leading axes.

        Per sequence it holds (kernel - 1) * (2 * key_dim + value_dim) conv inputs in `dtype`
        and value_heads * d_k * d_v fp32 numbers, whatever the sequence's length.
        """
        conv_dim, width = self.conv_weight.shape[-2], self.conv_weight.shape[-1] - 1  # stacked too
        return GatedDeltaNetState(
            jnp.zeros((*batch, width, conv_dim), dtype),
            jnp.zeros(
                (*batch, self.n_value_heads, self.key_head_dim, self.value_head_dim), jnp.float32
            ),
        )

    @jax.named_scope("eqllm.GatedDeltaNet")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        state: GatedDeltaNetState | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        *,
        form: Literal["chunked", "recurrent"] | None = None,
        valid: Bool[Array, "*batch seq"] | None = None,
    ) -> tuple[Float[Array, "*batch seq d_model"], GatedDeltaNetState]:
        """The layer's output for `x` and the state after its last token.

        `state` (None: `init_state`) continues an earlier call. `segment_ids` (None: one
        document) reset the state where the id changes from one token to the next; the given
        state continues the first document. `form` picks the delta rule's form (None:
        `recurrent` for one token, `chunked` otherwise); both give the same values. `valid`
        (None: every token) is False on left padding (a cached chunk's negative positions): a
        padding token neither reads nor changes the state, and its output means nothing.
        """
        batch, seq = x.shape[:-2], x.shape[-2]
        if state is None:
            state = self.init_state(batch, x.dtype)
        if form is None:
            form = "recurrent" if seq == 1 else "chunked"
        if form not in ("chunked", "recurrent"):
            raise EqllmError(f"form={form!r} must be 'chunked' or 'recurrent'")
        if segment_ids is None:
            reset = jnp.zeros((*batch, seq), bool)
        else:
            first = jnp.zeros((*batch, 1), bool)
            reset = jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], -1)
        mixed = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        b, a = self.b_proj(x).astype(jnp.float32), self.a_proj(x).astype(jnp.float32)
        beta = jax.nn.sigmoid(b) * (2.0 if self.allow_neg_eigval else 1.0)
        g = -jnp.exp(self.A_log.astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias.astype(jnp.float32)
        )
        key_dim = self.n_key_heads * self.key_head_dim
        valid = jnp.ones((*batch, seq), bool) if valid is None else valid
        # padding neither decays the state (g = 0) nor writes to it (beta = 0)
        g, beta = (jnp.where(valid[..., None], y, 0.0) for y in (g, beta))

        def one(mixed, beta, g, conv, s, reset, valid):  # one sequence
            mixed, conv = behind_padding(mixed, conv, valid)
            mixed, conv = causal_conv(mixed, self.conv_weight, conv, reset)
            q, k, v = jnp.split(mixed, [key_dim, 2 * key_dim], axis=-1)
            # (seq, heads * dim) -> (seq, heads, dim)
            q = q.reshape(seq, self.n_key_heads, self.key_head_dim)
            k = k.reshape(seq, self.n_key_heads, self.key_head_dim)
            v = v.reshape(seq, self.n_value_heads, self.value_head_dim)
            q, k = l2norm(q) * self.key_head_dim**-0.5, l2norm(k)
            k = jnp.where(valid[:, None, None], k, 0.0)  # padding leaves no key behind
            if form == "chunked":
                out, s = chunked(q, k, v, g, beta, s, chunk_size=self.chunk_size, reset=reset)
            else:
                out, s = recurrent(q, k, v, g, beta, s, reset=reset)
            return out, conv, s

        args = (mixed, beta, g, state.conv, state.recurrent, reset, valid)
        if batch:  # every leading axis folded into one, mapped over
            flat = [y.reshape(-1, *y.shape[len(batch) :]) for y in args]
            out, conv, s = jax.vmap(one)(*flat)
            out, conv, s = (y.reshape(*batch, *y.shape[1:]) for y in (out, conv, s))
        else:
            out, conv, s = one(*args)
        z = self.z_proj(x).reshape(*batch, seq, self.n_value_heads, self.value_head_dim)
        gated = self.norm(out) * jax.nn.silu(z.astype(jnp.float32))
        gated = gated.astype(x.dtype).reshape(*batch, seq, -1)
        return self.out_proj(gated), GatedDeltaNetState(conv, s)
