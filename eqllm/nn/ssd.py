"""The state-space-dual (SSD) scan of Mamba-2 (`eqllm.nn.Mamba2`), in its two forms with the
same values: `ssd_chunked` (training and prefill: within a chunk a masked attention-like product
built from segment sums of the log decays, across chunks a `lax.scan` carrying S) and
`ssd_recurrent` (decoding, token by token); and the layer's state between calls."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from eqllm.errors import EqllmError


class Mamba2State(eqx.Module):
    """What a Mamba-2 layer carries from one call to the next (stack it for layers).

    Attributes:
        conv: the convolution's last kernel - 1 inputs (x, B and C channels, before the conv).
        ssm: the state S of every head, in the layer's `state_dtype`.
    """

    conv: Float[Array, "*batch conv_width conv_dim"]
    ssm: Float[Array, "*batch heads head_dim d_state"]


def _prepare(x, dt, B, C, state, reset):
    """fp32 inputs with B and C repeated from groups to heads, a zero state and no resets by
    default."""
    seq, heads, head_dim = x.shape
    groups, d_state = B.shape[-2:]
    if heads % groups:
        raise EqllmError(f"n_groups={groups} must divide the heads={heads}")
    B, C = (jnp.repeat(v.astype(jnp.float32), heads // groups, axis=1) for v in (B, C))
    x, dt = x.astype(jnp.float32), dt.astype(jnp.float32)
    state = jnp.zeros((heads, head_dim, d_state), jnp.float32) if state is None else state
    reset = jnp.zeros(seq, bool) if reset is None else reset
    return x, dt, B, C, state.astype(jnp.float32), reset


def ssd_recurrent(
    x: Float[Array, "seq heads head_dim"],
    dt: Float[Array, "seq heads"],
    A: Float[Array, " heads"],
    B: Float[Array, "seq groups d_state"],
    C: Float[Array, "seq groups d_state"],
    state: Float[Array, "heads head_dim d_state"] | None = None,
    *,
    reset: Bool[Array, " seq"] | None = None,
) -> tuple[Float[Array, "seq heads head_dim"], Float[Array, "heads head_dim d_state"]]:
    """The SSD scan token by token (decoding one or a few tokens), without the D skip.

    `dt` is the time step after its bias, softplus and limits (> 0); `A` the decay rate (< 0);
    each group of B and C serves heads // groups consecutive heads. `state` (None: zeros) is S
    before the first token; `reset` (None: none) zeroes S before the tokens where it is True
    (a new document). Returns the outputs and S after the last token (fp32 arithmetic; the
    outputs in x's dtype, S in fp32).
    """
    out_dtype = x.dtype
    x, dt, B, C, state, reset = _prepare(x, dt, B, C, state, reset)
    A = A.astype(jnp.float32)

    def step(s, token):
        x_t, dt_t, b_t, c_t, r_t = token
        s = jnp.where(r_t, 0.0, s) * jnp.exp(dt_t * A)[:, None, None]
        s = s + (x_t * dt_t[:, None])[:, :, None] * b_t[:, None, :]
        return s, jnp.einsum("hpn,hn->hp", s, c_t)

    state, out = jax.lax.scan(step, state, (x, dt, B, C, reset))
    return out.astype(out_dtype), state


def ssd_chunked(
    x: Float[Array, "seq heads head_dim"],
    dt: Float[Array, "seq heads"],
    A: Float[Array, " heads"],
    B: Float[Array, "seq groups d_state"],
    C: Float[Array, "seq groups d_state"],
    state: Float[Array, "heads head_dim d_state"] | None = None,
    *,
    chunk_size: int = 256,
    reset: Bool[Array, " seq"] | None = None,
) -> tuple[Float[Array, "seq heads head_dim"], Float[Array, "heads head_dim d_state"]]:
    """The SSD scan chunk by chunk (training and prefill); the same values as `ssd_recurrent`.

    Within a chunk of `chunk_size` tokens the output is a masked product: token i reads token
    j <= i with weight (C_i . B_j) exp(a_{j+1} + ... + a_i) (a = dt * A, summed as a segment sum
    of the masked log decays, transformers' `segment_sum`, so no large cumulative sums are
    subtracted), plus the state carried in, decayed to i. Each chunk's contribution to the state
    is a product too; a `lax.scan` over chunks carries S. A sequence whose length is not a
    multiple of the chunk is padded with tokens that change nothing (dt = 0), as transformers
    pads to the chunk size. Arguments and results as `ssd_recurrent`.

    This function is the one seam for a fused kernel: a Pallas (or Triton) SSD kernel with this
    signature can replace its body and nothing else changes.
    """
    if chunk_size < 1:
        raise EqllmError(f"chunk_size={chunk_size} must be at least 1")
    out_dtype = x.dtype
    seq = x.shape[0]
    x, dt, B, C, state, reset = _prepare(x, dt, B, C, state, reset)
    pad = -seq % chunk_size
    n = (seq + pad) // chunk_size

    def chunks(v):  # (seq, heads, ...) -> (chunks, heads, chunk, ...)
        v = jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
        return jnp.swapaxes(v.reshape(n, chunk_size, *v.shape[1:]), 1, 2)

    a = dt * A.astype(jnp.float32)  # (seq, heads): log decay of each token
    xdt = x * dt[..., None]  # what each token writes, before its key
    a, xdt, B, C = (chunks(v) for v in (a, xdt, B, C))
    # Documents inside a chunk, as in eqllm.nn.gated_deltanet.chunked: token i reads token
    # j <= i only when no reset lies in (j, i], and the state carried in only when none lies
    # in [start, i].
    doc = jnp.cumsum(jnp.pad(reset, (0, pad)).reshape(n, chunk_size), axis=1)  # (n, chunk)
    causal = np.tril(np.ones((chunk_size, chunk_size), bool))
    same = (doc[:, :, None] == doc[:, None, :]) & causal  # (n, chunk, chunk)
    carry = (doc == 0).astype(jnp.float32)
    # seg[i, j] = a_{j+1} + ... + a_i for j <= i (0 above the diagonal): the cumulative sum
    # down the rows of a[k] masked to k > j.
    strict = np.tril(np.ones((chunk_size, chunk_size), bool), -1)
    seg = jnp.cumsum(jnp.where(strict, a[..., :, None], 0.0), axis=-2)  # (n, heads, i, j)
    decay = jnp.where(same[:, None], jnp.exp(seg), 0.0)
    scores = jnp.einsum("chin,chjn->chij", C, B) * decay
    out = scores @ xdt  # (n, heads, chunk, head_dim): within the chunk
    from_start = jnp.exp(jnp.cumsum(a, axis=-1)) * carry[:, None]  # (n, heads, chunk)
    # Each token's write decayed to the chunk's end (only the last document's tokens reach it).
    to_end = jnp.where(same[:, None, -1, :], jnp.exp(seg[..., -1, :]), 0.0)  # (n, heads, chunk)
    written = jnp.einsum("chl,chlp,chln->chpn", to_end, xdt, B)
    chunk_decay = jnp.exp(jnp.sum(a, axis=-1)) * carry[:, None, -1]  # (n, heads)

    def step(s, c):
        written_c, decay_c = c
        return s * decay_c[:, None, None] + written_c, s

    state, starts = jax.lax.scan(step, state, (written, chunk_decay))  # starts: S entering each
    out = out + jnp.einsum("chln,chpn->chlp", C, starts) * from_start[..., None]
    # (chunks, heads, chunk, head_dim) -> (chunks, chunk, heads, head_dim) -> (seq, ...)
    out = jnp.swapaxes(out, 1, 2).reshape(n * chunk_size, *out.shape[1:2], out.shape[-1])
    return out[:seq].astype(out_dtype), state
