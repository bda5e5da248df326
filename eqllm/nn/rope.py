"""Rotary position embeddings (Su et al., 2021, RoFormer) and the ways of stretching them.

The rotation pairs dimension i with i + rotary_dim/2 ("rotate half"), the layout Hugging Face
checkpoints use. A partial rotary embedding (GPT-NeoX, Phi-3) rotates only the leading
`rotary_dim` dims of each head; a second base (`local_theta`, Gemma 3) serves the layers that
attend through a sliding window, chosen per layer by a traced flag so both kinds of layer share
one scanned stack. A traced `rotate` flag turns the rotation off for a layer (a "NoPE" layer,
SmolLM3) the same way.

`RopeScaling` stretches the frequencies beyond the trained context, as transformers'
`ROPE_INIT_FUNCTIONS` do (the same inverse frequencies and attention factor): "linear"
(position interpolation, Chen et al., 2023), "llama3" (Llama 3.1 report, section 3.3), "yarn"
(Peng et al., 2023), "longrope" (Ding et al., 2024; Phi-3: short factors up to the original
context, long factors past it) and "dynamic" (NTK-aware base growing with the sequence). The
attention factor multiplies cos and sin, so it scales every attention score by its square.
Windowed layers with their own base (`local_theta`) are never scaled, as in Gemma 3 and OLMo 3.
"""

import dataclasses
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

ScalingKind = Literal["linear", "llama3", "yarn", "longrope", "dynamic"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched (hashable: a static field of RotaryEmbedding).

    Attributes:
        kind: "linear", "llama3", "yarn", "longrope" or "dynamic".
        factor: the context extension factor (longrope: None means the ratio of the context to
            `original_max_seq_len`, resolved by the caller).
        original_max_seq_len: the context the model was trained with (linear: unused).
        low_freq_factor: llama3: wavelengths longer than original / low_freq_factor are scaled.
        high_freq_factor: llama3: wavelengths shorter than original / high_freq_factor are kept.
        beta_fast: yarn: rotations bounding the extrapolated band (None: 32).
        beta_slow: yarn: rotations bounding the interpolated band (None: 1).
        mscale: yarn: with mscale_all_dim, the attention factor's numerator scale (DeepSeek).
        mscale_all_dim: yarn: the attention factor's denominator scale.
        attention_factor: yarn / longrope: the factor on cos and sin (None: the paper's value).
        truncate: yarn: round the band's bounds to whole dims.
        short_factor: longrope: per-frequency divisors within the original context.
        long_factor: longrope: per-frequency divisors past it.
    """

    kind: ScalingKind
    factor: float | None = None
    original_max_seq_len: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


def rope_inv_freq(dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None,
                  seq_len: int | None = None) -> np.ndarray:  # fmt: skip
    """Inverse frequencies theta^(-2i/d), i < d/2, stretched by `scaling`, as float64 numpy (a
    compile-time constant); `seq_len` picks longrope's set and dynamic's base (see
    `rope_frequencies`)."""
    return rope_frequencies(dim, theta, scaling, seq_len)[0]


def rope_frequencies(
    dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int | None = None
) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention factor) of `dim` rotated dims, as transformers'
    ROPE_INIT_FUNCTIONS compute them for a sequence of `seq_len` positions (None: up to the
    original context; only longrope and dynamic depend on it)."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / theta**exponents
    s = scaling
    if s is None:
        return inv_freq, 1.0
    if s.kind == "linear":
        return inv_freq / s.factor, 1.0
    if s.kind == "llama3":
        return _llama3(inv_freq, s), 1.0
    if s.kind == "yarn":
        return _yarn(dim, theta, s)
    if s.kind == "longrope":
        long = seq_len is not None and seq_len > s.original_max_seq_len
        factors = np.asarray(s.long_factor if long else s.short_factor, np.float64)
        return 1.0 / (factors * theta**exponents), _longrope_attention(s)
    # dynamic: the base grows once the sequence passes the original context.
    seq_len = max(seq_len or 0, s.original_max_seq_len)
    grown = s.factor * seq_len / s.original_max_seq_len - (s.factor - 1)
    return 1.0 / (theta * grown ** (dim / (dim - 2))) ** exponents, 1.0


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Wavelengths longer than original / low_freq_factor are divided by the factor, those
    shorter than original / high_freq_factor kept, the band between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(
        wavelen > low_wavelen,
        inv_freq / s.factor,
        np.where(wavelen < high_wavelen, inv_freq, interpolated),
    )


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN: frequencies above `beta_fast` rotations over the original context extrapolate,
    those below `beta_slow` interpolate (divided by the factor), a linear ramp between."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast or 32.0), correction_dim(s.beta_slow or 1.0)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (factor * base)) * (1 - extrapolate) + (1 / base) * extrapolate
    return inv_freq, float(attention)


def _longrope_attention(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    if s.factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_seq_len))


class RotaryEmbedding(eqx.Module):
    """Rotates query/key heads by their absolute position.

    Attributes:
        head_dim: size of one head (even unless `rotary_dim` is set).
        theta: base of the frequencies.
        scaling: how the frequencies are stretched (None: plain RoPE); see `RopeScaling`.
        local_theta: base used where `__call__` gets `local=True` (None: `theta` everywhere);
            those layers are never scaled.
        rotary_dim: rotate only the first `rotary_dim` dims of each head (None: all).
        still: the last `still` frequencies are 0, their pairs left as they are (Gemma 4's
            proportional RoPE: the turning ones keep their exponents over the whole head).
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(default=10000.0, static=True)
    scaling: RopeScaling | None = eqx.field(default=None, static=True)
    local_theta: float | None = eqx.field(default=None, static=True)
    rotary_dim: int | None = eqx.field(default=None, static=True)
    still: int = eqx.field(default=0, static=True)

    def __check_init__(self):
        dim = self.dim
        if dim % 2 or not 0 < dim <= self.head_dim:
            raise ValueError(
                f"RotaryEmbedding needs an even rotary_dim in (0, head_dim={self.head_dim}], "
                f"got {dim}"
            )

    @property
    def dim(self) -> int:
        """How many leading dims of each head are rotated."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def inv_freq(self) -> np.ndarray:
        """The inverse frequencies within the original context."""
        return rope_inv_freq(self.dim, self.theta, self.scaling)

    def _frequencies(self, positions) -> tuple[Float[Array, " half"], Float[Array, ""]]:
        """This call's inverse frequencies and attention factor. Longrope and dynamic depend on
        the largest position in the call, as in transformers (max(position_ids) + 1)."""
        s, dim = self.scaling, self.dim
        inv_freq, factor = rope_frequencies(dim, self.theta, s)
        inv_freq, factor = jnp.asarray(inv_freq, jnp.float32), jnp.float32(factor)
        if s is None or s.kind not in ("longrope", "dynamic"):
            return inv_freq, factor
        seq_len = jnp.max(positions) + 1
        beyond = seq_len > s.original_max_seq_len
        if s.kind == "longrope":
            long, _ = rope_frequencies(dim, self.theta, s, s.original_max_seq_len + 1)
            return jnp.where(beyond, jnp.asarray(long, jnp.float32), inv_freq), factor
        # dynamic, in fp32 like transformers: the base grows with the sequence.
        grown = s.factor * seq_len.astype(jnp.float32) / s.original_max_seq_len - (s.factor - 1)
        base = self.theta * grown ** (dim / (dim - 2))
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        return jnp.where(beyond, 1.0 / base**exponents, inv_freq), factor

    @jax.named_scope("eqllm.RotaryEmbedding")
    def __call__(
        self,
        x: Float[Array, "*batch seq heads head_dim"],
        positions: Int[Array, "*#batch seq"],
        local: Bool[Array, ""] | bool | None = None,
        rotate: Bool[Array, ""] | bool | None = None,
    ) -> Float[Array, "*batch seq heads head_dim"]:
        """`x` rotated to `positions` (which may omit the batch axes: one row for all).

        `local` (a traced per-layer flag is fine) picks `local_theta` over `theta`. `rotate`
        False (a Python or a traced per-layer flag) returns `x` unrotated, a NoPE layer; None
        or True rotates.
        """
        if isinstance(rotate, bool | np.bool_) and not rotate:
            return x
        inv_freq, factor = self._frequencies(positions)
        if self.still:  # proportional: the trailing frequencies stand still
            inv_freq = inv_freq.at[inv_freq.shape[-1] - self.still :].set(0.0)
        if self.local_theta is not None and local is not None:
            local_freq = jnp.asarray(rope_inv_freq(self.dim, self.local_theta), jnp.float32)
            inv_freq = jnp.where(local, local_freq, inv_freq)
            factor = jnp.where(local, 1.0, factor)
        if rotate is not None and not isinstance(rotate, bool | np.bool_):
            # A NoPE layer in a scanned stack: angle 0 and no attention factor (cos 1, sin 0)
            # leave every dim exactly as it is.
            inv_freq = jnp.where(rotate, inv_freq, 0.0)
            factor = jnp.where(rotate, factor, 1.0)
        # angles: (..., seq, dim/2), in fp32 so long positions keep their precision.
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        cos = (jnp.cos(angles) * factor)[..., None, :]
        sin = (jnp.sin(angles) * factor)[..., None, :]
        x32 = x.astype(jnp.float32)
        x1, x2 = jnp.split(x32[..., : self.dim], 2, axis=-1)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.dim < self.head_dim:  # partial rotary: the trailing dims pass through
            parts.append(x32[..., self.dim :])
        return jnp.concatenate(parts, axis=-1).astype(x.dtype)
