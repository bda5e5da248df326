"""Attention through `jax.nn.dot_product_attention`, whose `implementation="cudnn"` is cuDNN's
fused (flash) kernel on NVIDIA GPUs (Dao et al., 2022).

`fused_arguments` is the one place where eqllm's masking (causal by positions, sliding window,
empty key slots, per-layer local flag, packed segments; see `eqllm.nn.attention`) is translated
into that function's arguments. The GPU path and the CPU test that checks it call the same
builder, so the only thing a GPU run changes is the `implementation` switch.

`jax.nn.dot_product_attention` has no segment-id argument (its `query_seq_lengths` and
`key_value_seq_lengths` describe right padding, one run of tokens per row), so packed segments
become a boolean mask (batch, 1, seq, seq) beside `is_causal` and `local_window_size`: cuDNN
applies the mask as a bias and still skips the blocks above the diagonal.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqllm.nn.mask import attention_mask


def fused_arguments(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    positions: Int[Array, "*batch seq"] | None,
    *,
    sliding_window: int | None,
    local: Bool[Array, ""] | bool | None,
    scale: float,
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> dict:
    """Keyword arguments (all but `implementation`) for `jax.nn.dot_product_attention`.

    Leading axes are flattened into the one batch axis it takes. `positions` None means
    0..seq-1: the causal mask and the window become `is_causal` and `local_window_size`, which
    cuDNN turns into skipped blocks rather than a mask; `local` must then be a Python bool or
    None (`fused_attention` branches on a traced flag). Explicit positions (padding, offsets)
    become a boolean mask of shape (batch, 1, seq, seq), which a traced `local` may shape.
    Grouped kv heads are passed as they are: the function groups query heads itself.
    `segment_ids` (None: one segment) add a mask keeping each query to its own segment's keys.
    """
    *lead, seq, heads, head_dim = q.shape
    args = dict(
        query=q.reshape(-1, seq, heads, head_dim),
        key=k.reshape(-1, *k.shape[-3:]),
        value=v.reshape(-1, *v.shape[-3:]),
        scale=scale,
    )
    if positions is None:
        if sliding_window is not None and not isinstance(local, bool | np.bool_ | None):
            raise TypeError("a traced `local` flag needs explicit positions or fused_attention")
        args["is_causal"] = True
        if sliding_window is not None and local is not False:
            # eqllm keeps keys with q - k < window: window - 1 keys to the left of the query.
            args["local_window_size"] = (sliding_window - 1, 0)
        if segment_ids is not None:
            same = segment_ids[..., :, None] == segment_ids[..., None, :]
            args["mask"] = jnp.broadcast_to(same, (*lead, seq, seq)).reshape(-1, 1, seq, seq)
    else:
        mask = attention_mask(positions, positions, sliding_window, local, segment_ids, segment_ids)
        mask = jnp.broadcast_to(mask, (*lead, seq, seq))
        args["mask"] = mask.reshape(-1, 1, seq, seq)
    return args


def fused_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    positions: Int[Array, "*batch seq"] | None = None,
    *,
    sliding_window: int | None = None,
    local: Bool[Array, ""] | bool | None = None,
    scale: float,
    implementation: str = "cudnn",
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Causal self-attention by `jax.nn.dot_product_attention(implementation=...)`.

    The same values as `eqllm.nn.attention.dot_product_attention` with `attention_mask`
    (without soft-capping, which the fused kernel cannot do). A traced `local` flag with default
    positions picks the windowed or the global call with `lax.cond`, so each keeps its
    block-skipping causal form. Query rows at negative (padding) positions return zeros, as
    eqllm's own attention does. `segment_ids` (None: one segment) keep attention inside each
    packed document.
    """

    def attend(flag):
        args = fused_arguments(
            q,
            k,
            v,
            positions,
            sliding_window=sliding_window,
            local=flag,
            scale=scale,
            segment_ids=segment_ids,
        )
        return jax.nn.dot_product_attention(**args, implementation=implementation)

    traced = not isinstance(local, bool | np.bool_ | None)
    if positions is None and sliding_window is not None and traced:
        out = jax.lax.cond(local, lambda: attend(True), lambda: attend(False))
    else:
        out = attend(local)
    out = out.reshape(q.shape)
    if positions is not None:
        out = jnp.where((positions >= 0)[..., None, None], out, jnp.zeros((), out.dtype))
    return out
