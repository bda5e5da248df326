"""The attention mask by positions and segments, shared by eqllm's attention and the fused path."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def attention_mask(
    q_positions: Int[Array, "*batch seq"],
    k_positions: Int[Array, "*batch kv_seq"],
    sliding_window: int | None = None,
    local: Bool[Array, ""] | bool | None = None,
    q_segments: Int[Array, "*batch seq"] | None = None,
    k_segments: Int[Array, "*batch kv_seq"] | None = None,
    chunk_size: int | None = None,
) -> Bool[Array, "*batch seq kv_seq"]:
    """True where query i may attend to key j (causal, within the window or the same chunk of
    `chunk_size` positions, key slot filled, and, given segment ids, in the same segment:
    packed documents never attend across).

    `local` False lifts the window or the chunk (a global layer); None or True keeps it.
    Chunks are counted from position 0, so a packed document with its own positions (restarting
    at 0) has the chunks it has alone.
    """
    q = q_positions[..., :, None]
    k = k_positions[..., None, :]
    allowed = (k <= q) & (k >= 0)
    if sliding_window is not None or chunk_size is not None:
        if chunk_size is not None:
            inside = q // chunk_size == k // chunk_size
        else:
            inside = q - k < sliding_window
        if local is not None:
            inside = inside | jnp.logical_not(local)
        allowed = allowed & inside
    if q_segments is not None and k_segments is not None:
        allowed = allowed & (q_segments[..., :, None] == k_segments[..., None, :])
    return allowed
