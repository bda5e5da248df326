"""Mamba-2 (Dao & Gu, 2024, "Transformers are SSMs"): a selective state-space layer in its
state-space-dual (SSD) form.

Each head h keeps a state S of shape (head_dim, d_state). For every token, S decays by
exp(dt * A_h), the token's input x (one head_dim vector per head) is written along its key B,
and the query C reads it, plus a skip D:

    S = exp(dt * A) * S + dt * x B^T;   y = S C + D * x

as transformers' `Mamba2Mixer` computes it: one input projection to z, x, B, C and dt; a short
causal depthwise convolution (with bias) and SiLU over x, B and C; dt = softplus(dt + dt_bias)
clamped to `time_step_limit`; a scalar decay per head A = -exp(A_log); B and C shared by groups
of consecutive heads (`n_groups`, as key heads are in grouped-query attention); the output gated
by z through an RMSNorm taken per group (norm(y * silu(z)) * w, transformers'
`MambaRMSNormGated`), then the output projection. Falcon-H1's variants are switches: the norm
before the gate (norm(y) * w * silu(z)) or none (y * silu(z)), and constant multipliers on the
input and on each of the five projections' outputs (its muP multipliers).

The scan (`eqllm.nn.ssd`) has two forms with the same values: `ssd_chunked` (training and
prefill) and `ssd_recurrent` (decoding, token by token). The state a call returns (the
convolution's last inputs and S) continues the sequence in the next call, in either form;
segment ids reset both at document boundaries, so packed documents never see each other.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqllm.errors import EqllmError
from eqllm.nn.conv import behind_padding, causal_conv
from eqllm.nn.linear import Linear
from eqllm.nn.norm import RMSNorm
from eqllm.nn.ssd import Mamba2State, ssd_chunked, ssd_recurrent

StateDType = Literal["float32", "bfloat16", "float16"]
GateNorm = Literal["after_gate", "before_gate", "none"]


class Mamba2(eqx.Module):
    """A Mamba-2 token mixer over one sequence or a batch of them (leading axes).

    Arguments:
        d_model: input and output size.
        n_heads: SSM heads (transformers' `num_heads`).
        head_dim: size of each head's input x (the inner size is n_heads * head_dim).
        d_state: size of each head's state per input channel (`state_size`).
        n_groups: groups of heads sharing B and C, and groups of the gated norm.
        conv_kernel: width of the causal convolution over x, B and C.
        norm_eps: epsilon of the gated RMSNorm.
        chunk_size: tokens per chunk of the chunked form.
        dt_min: the lower limit dt is clamped to (transformers' `time_step_limit[0]`).
        dt_max: the upper limit (`time_step_limit[1]`; None: none).
        state_dtype: dtype of the state S between calls (`mamba_ssm_cache_dtype`); the
            arithmetic within a call is fp32 whatever it is.
        gate_norm: "after_gate": norm(y * silu(z)) * w (Mamba-2); "before_gate": norm(y) * w *
            silu(z); "none": y * silu(z), no norm and no weight (Falcon-H1's mamba_rms_norm
            false).
        in_multiplier: multiplies the input before the projections (Falcon-H1's
            ssm_in_multiplier).
        multipliers: multiply the outputs of the z, x, B, C and dt projections (Falcon-H1's
            ssm_multipliers, its `mup_vector`).

    The input projection is five `Linear` layers (z, x, B, C, dt): transformers stores them
    stacked in that order as `in_proj`, and adapters and sharding see one matrix per role.
    `conv_weight` and `conv_bias` are torch's `conv1d.weight` (without its middle axis) and
    `conv1d.bias`, channels in the order x, B, C, so they import as they are.
    """

    z_proj: Linear
    x_proj: Linear
    B_proj: Linear
    C_proj: Linear
    dt_proj: Linear
    out_proj: Linear
    conv_weight: Float[Array, "conv_dim kernel"]
    conv_bias: Float[Array, " conv_dim"]
    A_log: Float[Array, " heads"]
    dt_bias: Float[Array, " heads"]
    D: Float[Array, " heads"]
    norm: RMSNorm | None
    n_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    d_state: int = eqx.field(static=True)
    n_groups: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    dt_min: float = eqx.field(static=True)
    dt_max: float | None = eqx.field(static=True)
    state_dtype: StateDType = eqx.field(static=True)
    gate_norm: GateNorm = eqx.field(static=True)
    in_multiplier: float = eqx.field(static=True)
    multipliers: tuple[float, float, float, float, float] = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        d_state: int,
        *,
        n_groups: int = 1,
        conv_kernel: int = 4,
        norm_eps: float = 1e-5,
        chunk_size: int = 256,
        dt_min: float = 0.0,
        dt_max: float | None = None,
        state_dtype: StateDType = "float32",
        gate_norm: GateNorm = "after_gate",
        in_multiplier: float = 1.0,
        multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0),
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if n_heads % n_groups:
            raise EqllmError(f"n_groups={n_groups} must divide n_heads={n_heads}")
        for name, value in (("conv_kernel", conv_kernel), ("chunk_size", chunk_size)):
            if value < 1:
                raise EqllmError(f"{name}={value} must be at least 1")
        if state_dtype not in ("float32", "bfloat16", "float16"):
            raise EqllmError(f"state_dtype={state_dtype!r} must be float32, bfloat16 or float16")
        if gate_norm not in ("after_gate", "before_gate", "none"):
            raise EqllmError(f"gate_norm={gate_norm!r} must be after_gate, before_gate or none")
        if len(multipliers) != 5:
            raise EqllmError(f"multipliers={multipliers!r} must be five numbers (z, x, B, C, dt)")
        keys = jax.random.split(key, 9)
        inner, bc = n_heads * head_dim, n_groups * d_state

        def linear(i, n_out, axes, init="normal", n_in=d_model):
            return Linear(n_in, n_out, axes=axes, init=init, key=keys[i], dtype=dtype)

        self.z_proj = linear(0, inner, ("heads", "d_model"))
        self.x_proj = linear(1, inner, ("heads", "d_model"))
        self.B_proj = linear(2, bc, ("kv_heads", "d_model"))
        self.C_proj = linear(3, bc, ("kv_heads", "d_model"))
        self.dt_proj = linear(4, n_heads, ("heads", "d_model"))
        self.out_proj = linear(5, d_model, ("d_model", "heads"), "residual", inner)
        # torch's Conv1d default (transformers' kaiming_uniform(a=sqrt(5))): uniform within
        # 1/sqrt(fan_in), fan_in being the kernel width; the bias starts at zero.
        bound = conv_kernel**-0.5
        shape = (inner + 2 * bc, conv_kernel)
        self.conv_weight = jax.random.uniform(keys[6], shape, dtype, -bound, bound)
        self.conv_bias = jnp.zeros(inner + 2 * bc, dtype)
        # As transformers initialises them: A = 1 .. n_heads (heads decay fast to slow), D = 1,
        # and dt_bias the inverse softplus of a dt drawn log-uniformly in [0.001, 0.1].
        self.A_log = jnp.log(jnp.arange(1, n_heads + 1, dtype=jnp.float32)).astype(dtype)
        self.D = jnp.ones(n_heads, dtype)
        u = jax.random.uniform(keys[7], (n_heads,), jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (np.log(0.1) - np.log(0.001)) + np.log(0.001)), 1e-4)
        self.dt_bias = (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
        self.norm = None if gate_norm == "none" else RMSNorm(inner, eps=norm_eps, dtype=dtype)
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.d_state = d_state
        self.n_groups = n_groups
        self.chunk_size = chunk_size
        self.dt_min = float(dt_min)
        self.dt_max = None if dt_max is None else float(dt_max)
        self.state_dtype = state_dtype
        self.gate_norm = gate_norm
        self.in_multiplier = float(in_multiplier)
        self.multipliers = tuple(float(m) for m in multipliers)

    def init_state(self, batch: tuple[int, ...] = (), dtype=jnp.float32) -> Mamba2State:
        """The state before a sequence's first token: zeros, for `batch` leading axes.

        Per sequence it holds (kernel - 1) * (inner + 2 * n_groups * d_state) conv inputs in
        `dtype` and n_heads * head_dim * d_state numbers in `state_dtype`, whatever the
        sequence's length.
        """
        conv_dim, width = self.conv_weight.shape[-2], self.conv_weight.shape[-1] - 1  # stacked too
        ssm = (*batch, self.n_heads, self.head_dim, self.d_state)
        return Mamba2State(
            jnp.zeros((*batch, width, conv_dim), dtype), jnp.zeros(ssm, self.state_dtype)
        )

    def gated_norm(
        self, y: Float[Array, "*rows inner"], z: Float[Array, "*rows inner"]
    ) -> Float[Array, "*rows inner"]:
        """norm(y * silu(z)) * w in fp32, the mean square taken over each of the n_groups
        groups of channels (transformers' `MambaRMSNormGated` with group_size inner / n_groups);
        norm(y) * w * silu(z) or y * silu(z) as `gate_norm` says."""
        gate = jax.nn.silu(z.astype(jnp.float32))
        g = y.astype(jnp.float32)
        if self.norm is None:
            return g * gate
        g = g if self.gate_norm == "before_gate" else g * gate
        grouped = g.reshape(*g.shape[:-1], self.n_groups, -1)  # (..., groups, inner / groups)
        ms = jnp.mean(grouped * grouped, axis=-1, keepdims=True)
        normed = (grouped * jax.lax.rsqrt(ms + self.norm.eps)).reshape(g.shape)
        normed = normed * self.norm.weight.astype(jnp.float32)
        return normed * gate if self.gate_norm == "before_gate" else normed

    def projections(self, x: Float[Array, "*rows d_model"]) -> tuple[Array, ...]:
        """z, x, B, C and dt from the input, each times its multiplier (after the input's)."""
        x = x if self.in_multiplier == 1.0 else x * self.in_multiplier
        projs = (self.z_proj, self.x_proj, self.B_proj, self.C_proj, self.dt_proj)
        return tuple(
            p(x) if m == 1.0 else p(x) * m for p, m in zip(projs, self.multipliers, strict=True)
        )

    def time_step(self, dt: Float[Array, "*rows heads"]) -> Float[Array, "*rows heads"]:
        """softplus(dt + dt_bias) clamped to [dt_min, dt_max], in fp32."""
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias.astype(jnp.float32))
        return jnp.clip(dt, self.dt_min, self.dt_max)

    @jax.named_scope("eqllm.Mamba2")
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        state: Mamba2State | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        *,
        form: Literal["chunked", "recurrent"] | None = None,
        valid: Bool[Array, "*batch seq"] | None = None,
    ) -> tuple[Float[Array, "*batch seq d_model"], Mamba2State]:
        """The layer's output for `x` and the state after its last token.

        `state` (None: `init_state`) continues an earlier call. `segment_ids` (None: one
        document) reset the state where the id changes from one token to the next; the given
        state continues the first document. `form` picks the scan's form (None: `recurrent`
        for one token, `chunked` otherwise); both give the same values. `valid` (None: every
        token) is False on left padding (a cached chunk's negative positions): a padding token
        neither reads nor changes the state (nor the convolution's), and its output means
        nothing.
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
        z, xs, B, C, dt = self.projections(x)
        mixed = jnp.concatenate([xs, B, C], axis=-1)
        dt = self.time_step(dt)
        padded = valid is not None  # else the forward of whole sequences, left as it was
        if padded:  # padding neither decays S nor writes to it
            dt = jnp.where(valid[..., None], dt, 0.0)
        else:
            valid = jnp.ones((*batch, seq), bool)
        A = -jnp.exp(self.A_log.astype(jnp.float32))
        inner, bc = self.n_heads * self.head_dim, self.n_groups * self.d_state

        def one(mixed, dt, conv, s, reset, valid):  # one sequence
            if padded:
                mixed, conv = behind_padding(mixed, conv, valid)
            mixed, conv = causal_conv(mixed, self.conv_weight, conv, reset, self.conv_bias)
            xs, B, C = jnp.split(mixed, [inner, inner + bc], axis=-1)
            # (seq, heads * head_dim) -> (seq, heads, head_dim); (seq, groups, d_state)
            xs = xs.reshape(seq, self.n_heads, self.head_dim)
            B = B.reshape(seq, self.n_groups, self.d_state)
            C = C.reshape(seq, self.n_groups, self.d_state)
            if form == "chunked":
                y, s_out = ssd_chunked(xs, dt, A, B, C, s, chunk_size=self.chunk_size, reset=reset)
            else:
                y, s_out = ssd_recurrent(xs, dt, A, B, C, s, reset=reset)
            y = y.astype(jnp.float32) + self.D.astype(jnp.float32)[:, None] * xs
            return y, conv, s_out.astype(s.dtype)

        args = (mixed, dt, state.conv, state.ssm, reset, valid)
        if batch:  # every leading axis folded into one, mapped over
            flat = [v.reshape(-1, *v.shape[len(batch) :]) for v in args]
            y, conv, s = jax.vmap(one)(*flat)
            y, conv, s = (v.reshape(*batch, *v.shape[1:]) for v in (y, conv, s))
        else:
            y, conv, s = one(*args)
        gated = self.gated_norm(y.reshape(*batch, seq, inner), z).astype(x.dtype)
        return self.out_proj(gated), Mamba2State(conv, s)
