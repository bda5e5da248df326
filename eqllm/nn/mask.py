"""The attention mask by positions, shared by eqllm's own attention and the fused path."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def attention_mask(
    q_positions: Int[Array, "*batch seq"],
    k_positions: Int[Array, "*batch kv_seq"],
    sliding_window: int | None = None,
    local: Bool[Array, ""] | bool | None = None,
) -> Bool[Array, "*batch seq kv_seq"]:
    """True where query i may attend to key j (causal, within the window, key slot filled).

    `local` False lifts the window (a global layer); None or True keeps it.
    """
    q = q_positions[..., :, None]
    k = k_positions[..., None, :]
    allowed = (k <= q) & (k >= 0)
    if sliding_window is not None:
        inside = q - k < sliding_window
        if local is not None:
            inside = inside | jnp.logical_not(local)
        allowed = allowed & inside
    return allowed
