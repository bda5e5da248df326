"""eqllm.nn layers used on their own, with plain sizes (no eqllm config)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.nn import (
    MLP,
    Attention,
    Block,
    GatedMLP,
    LayerNorm,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    rope_inv_freq,
)
from eqllm.nn.attention import attention_mask, dot_product_attention, in_order_attention


def test_rmsnorm_statistics_in_fp32():
    x = jnp.array([300.0, -200.0, 100.0, 0.5], jnp.bfloat16)
    y = RMSNorm(4)(x)
    assert y.dtype == jnp.bfloat16
    x32 = np.asarray(x, np.float32)
    expected = x32 / np.sqrt(np.mean(x32**2) + 1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=1e-2)
    plus_one = RMSNorm(4, plus_one=True)
    # weight 0 -> scale 1
    np.testing.assert_allclose(plus_one(jnp.asarray(x32)), expected, rtol=1e-5)


def test_layernorm_matches_closed_form():
    x = jnp.arange(6.0)
    y = LayerNorm(6)(x)
    np.testing.assert_allclose(y, (x - 2.5) / np.sqrt(np.var(np.arange(6.0)) + 1e-5), rtol=1e-5)


def test_rope_preserves_norm_and_relative_position():
    rope = RotaryEmbedding(8)
    q = jax.random.normal(jax.random.key(0), (1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 8))
    np.testing.assert_allclose(
        jnp.linalg.norm(rope(q, jnp.array([5]))), jnp.linalg.norm(q), rtol=1e-5
    )

    def score(i, j):
        return jnp.sum(rope(q, jnp.array([i])) * rope(k, jnp.array([j])))

    np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)  # depends on i - j only


def test_rope_llama3_scaling_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=scaling,
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    ours = rope_inv_freq(
        64,
        500000.0,
        RopeScaling(
            "llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_seq_len=8192,
        ),
    )
    np.testing.assert_allclose(ours, expected.double().numpy(), rtol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_layer_standalone(kv_heads):
    attn = Attention(
        32,
        4,
        n_kv_heads=kv_heads,
        qkv_bias=True,
        qk_norm=True,
        rope=RotaryEmbedding(8),
        sliding_window=4,
        key=jax.random.key(0),
    )
    x = jax.random.normal(jax.random.key(1), (10, 32))
    y = attn(x)
    assert y.shape == (10, 32)
    # Causal and windowed: the first output depends on the first input only.
    y2 = attn(x.at[5].set(0.0))
    np.testing.assert_allclose(y[:5], y2[:5], atol=1e-6)
    np.testing.assert_allclose(y[9], y2[9], atol=1e-6)  # 5 is outside 9's window of 4


@pytest.mark.parametrize(
    "seq, window",
    [
        (256, None),
        *(pytest.param(*c, marks=pytest.mark.slow) for c in ((200, None), (256, 100), (130, 3))),
    ],
)
def test_in_order_attention_equals_full_masked_attention(seq, window):
    """Skipping future key blocks changes no value: same as the full mask, any split."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, seq, 4, 8))
    k = jax.random.normal(kk, (2, seq, 2, 8))
    v = jax.random.normal(kv, (2, seq, 2, 8))
    positions = jnp.arange(seq)
    full = jax.jit(dot_product_attention)(q, k, v, attention_mask(positions, positions, window))
    # Jitted: one compile per split instead of one per primitive and shape, op by op.
    skip = jax.jit(in_order_attention, static_argnames=("sliding_window", "chunks"))
    for chunks in (1, 3, 4):
        skipped = skip(q, k, v, sliding_window=window, chunks=chunks)
        np.testing.assert_allclose(skipped, full, atol=2e-6)


def test_attention_on_a_batch_equals_one_sequence_at_a_time():
    attn = Attention(32, 4, n_kv_heads=2, rope=RotaryEmbedding(8), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 70, 32))
    batched = attn(x)  # default positions: the block-skipping path
    positions = jnp.broadcast_to(jnp.arange(70), (3, 70))
    np.testing.assert_allclose(batched, attn(x, positions), atol=2e-6)  # full-mask path
    np.testing.assert_allclose(batched[1], attn(x[1]), atol=2e-6)


def test_attention_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        Attention(32, 4, n_kv_heads=3, key=jax.random.key(0))


def test_mlps_and_block_compose():
    key = jax.random.key(0)
    x = jax.random.normal(key, (6, 16))
    for mlp in (
        MLP(16, 64, key=key),
        GatedMLP(16, 48, activation="gelu", key=key),
        GatedMLP(16, 48, key=key),
    ):
        block = Block(RMSNorm(16), Attention(16, 2, key=key), LayerNorm(16), mlp)
        assert block(x).shape == (6, 16)
    # beartype (active in tests) or the layer's own check refuses it.
    with pytest.raises((ValueError, TypeError), match="relu"):
        GatedMLP(16, 48, activation="relu", key=key)
