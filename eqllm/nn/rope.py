"""Rotary position embeddings (Su et al., 2021, RoFormer) with the Llama 3 frequency scaling.

The rotation pairs dimension i with i + rotary_dim/2 ("rotate half"), the layout Hugging Face
checkpoints use. A partial rotary embedding (GPT-NeoX, Phi-3) rotates only the leading
`rotary_dim` dims of each head; a second base (`local_theta`, Gemma 3) serves the layers that
attend through a sliding window, chosen per layer by a traced flag so both kinds of layer share
one scanned stack.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


def rope_inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    *,
    llama3_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
) -> np.ndarray:
    """Inverse frequencies theta^(-2i/d), i < d/2, as float64 numpy (a compile-time constant).

    With `llama3_factor`, wavelengths longer than original_max_seq_len / low_freq_factor are
    divided by the factor, those shorter than original_max_seq_len / high_freq_factor are kept,
    and the band between is interpolated smoothly (Llama 3.1 report, section 3.3; the same rule
    as transformers' "llama3" rope_type).
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if llama3_factor is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_seq_len / low_freq_factor
    high_wavelen = original_max_seq_len / high_freq_factor
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / llama3_factor + smooth * inv_freq
    return np.where(
        wavelen > low_wavelen,
        inv_freq / llama3_factor,
        np.where(wavelen < high_wavelen, inv_freq, interpolated),
    )


class RotaryEmbedding(eqx.Module):
    """Rotates query/key heads by their absolute position.

    Attributes:
        head_dim: size of one head (even unless `rotary_dim` is set).
        theta: base of the frequencies.
        llama3_factor: the Llama 3 scaling factor (see `rope_inv_freq`); None disables it.
        low_freq_factor: Llama 3 scaling: the low-frequency factor.
        high_freq_factor: Llama 3 scaling: the high-frequency factor.
        original_max_seq_len: Llama 3 scaling: the context the model was trained with.
        local_theta: base used where `__call__` gets `local=True` (None: `theta` everywhere).
        rotary_dim: rotate only the first `rotary_dim` dims of each head (None: all).
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(default=10000.0, static=True)
    llama3_factor: float | None = eqx.field(default=None, static=True)
    low_freq_factor: float = eqx.field(default=1.0, static=True)
    high_freq_factor: float = eqx.field(default=4.0, static=True)
    original_max_seq_len: int = eqx.field(default=8192, static=True)
    local_theta: float | None = eqx.field(default=None, static=True)
    rotary_dim: int | None = eqx.field(default=None, static=True)

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
        return self._inv_freq(self.theta)

    def _inv_freq(self, theta: float) -> np.ndarray:
        return rope_inv_freq(
            self.dim,
            theta,
            llama3_factor=self.llama3_factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            original_max_seq_len=self.original_max_seq_len,
        )

    @jax.named_scope("eqllm.RotaryEmbedding")
    def __call__(
        self,
        x: Float[Array, "*batch seq heads head_dim"],
        positions: Int[Array, "*#batch seq"],
        local: Bool[Array, ""] | bool | None = None,
    ) -> Float[Array, "*batch seq heads head_dim"]:
        """`x` rotated to `positions` (which may omit the batch axes: one row for all).

        `local` (a traced per-layer flag is fine) picks `local_theta` over `theta`.
        """
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        if self.local_theta is not None and local is not None:
            local_freq = jnp.asarray(self._inv_freq(self.local_theta), jnp.float32)
            inv_freq = jnp.where(local, local_freq, inv_freq)
        # angles: (..., seq, dim/2), in fp32 so long positions keep their precision.
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        cos = jnp.cos(angles)[..., None, :]
        sin = jnp.sin(angles)[..., None, :]
        x32 = x.astype(jnp.float32)
        x1, x2 = jnp.split(x32[..., : self.dim], 2, axis=-1)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.dim < self.head_dim:  # partial rotary: the trailing dims pass through
            parts.append(x32[..., self.dim :])
        return jnp.concatenate(parts, axis=-1).astype(x.dtype)
