"""bf16 mixed precision: fp32 parameters, bf16 matmuls and activations, fp32 norm statistics,
softmax and logits.

The check is against a reference that spells the same policy out in plain jax: a Llama forward
with bf16 weights and activations and exactly the listed steps in fp32. A precision mistake in
the model moves its logits 7-10x further from the reference than the model is: tried by
patching eqllm's attention to take its softmax in bf16 (max |difference| 0.036) and its RMSNorm
to compute in bf16 (0.054), against 0.0054 for the model as it is (this module's CONFIG and
tokens). The test below makes the same mistakes in the reference to show the margin.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm

BF16, F32 = jnp.bfloat16, jnp.float32
# init_std 0.1: logits of scale ~1 (up to ~3), so bf16's roundings show in the second decimal.
CONFIG = eqllm.zoo.config(
    "llama-nano",
    vocab_size=97,
    d_model=64,
    n_layers=2,
    attention={"n_heads": 4, "n_kv_heads": 2},
    mlp={"d_ff": 128},
    max_seq_len=128,
    init_std=0.1,
)
TOL = 0.015  # max |logit difference| to the reference: 3x the measured 0.0054


def llama_in_bf16(model, tokens, *, softmax=F32, norm=F32, logits=F32):
    """Llama's forward with bf16 weights and activations; norm statistics, attention scores and
    softmax, and the logits in the dtypes given (fp32: the policy; bf16: a mistake)."""
    c = model.config
    p = jax.tree.map(lambda a: a.astype(BF16) if a.dtype == F32 else a, model)
    inv = jnp.asarray(model.blocks.attn.rope.inv_freq, F32).reshape(-1, c.head_dim // 2)[0]
    B, T = tokens.shape
    H, K, D = c.attention.n_heads, c.attention.n_kv_heads, c.head_dim

    def mm(x, w):
        return jnp.einsum("...i,oi->...o", x, w)

    def rms(x, w):
        x = x.astype(norm)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + c.norms.eps)
        return (y * w.astype(norm)).astype(BF16)

    def rope(x):
        angles = jnp.arange(T, dtype=F32)[:, None] * inv
        cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
        x1, x2 = jnp.split(x.astype(F32), 2, -1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(BF16)

    causal = jnp.tril(jnp.ones((T, T), bool))
    x = p.embed.weight[tokens]
    for i in range(c.n_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], p.blocks)
        attn, mlp = layer.attn, layer.mlp
        h = rms(x, layer.attn_norm.weight)
        q = rope(mm(h, attn.q_proj.weight).reshape(B, T, H, D))
        k = rope(mm(h, attn.k_proj.weight).reshape(B, T, K, D))
        v = mm(h, attn.v_proj.weight).reshape(B, T, K, D)
        k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=softmax) * D**-0.5
        probs = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(BF16)
        o = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * D)
        x = x + mm(o, attn.o_proj.weight)
        h = rms(x, layer.mlp_norm.weight)
        x = x + mm(jax.nn.silu(mm(h, mlp.gate.weight)) * mm(h, mlp.up.weight), mlp.down.weight)
    h = rms(x, p.final_norm.weight)
    return jnp.einsum("...i,oi->...o", h, p.lm_head.weight, preferred_element_type=logits)


@pytest.fixture(scope="module")
def runs():
    """(bf16 model, its logits, the reference's logits, tokens)."""
    fp32_model = eqllm.CausalLM(CONFIG, key=jax.random.key(0))
    model = fp32_model.with_config(compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 97)
    logits = jax.jit(lambda m, t: m(t))(model, tokens)
    reference = jax.jit(llama_in_bf16)(fp32_model, tokens)
    return model, np.asarray(logits), np.asarray(reference), tokens


def test_bf16_compute_keeps_fp32_params_and_matches_the_reference(runs):
    model, logits, reference, _ = runs
    assert model.blocks.attn.q_proj.weight.dtype == jnp.float32
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference, rtol=0, atol=TOL)


def test_logits_are_computed_in_fp32(runs):
    """fp32 logits are almost never exactly representable in bf16; bf16 ones always are."""
    _, logits, _, _ = runs
    representable = np.asarray(jnp.asarray(logits).astype(BF16).astype(F32)) == logits
    assert representable.mean() < 0.1


@pytest.mark.parametrize("mistake", ["softmax", "norm"])
def test_the_check_catches_a_precision_mistake(runs, mistake):
    """The same reference with one fp32 step done in bf16 lies well outside the tolerance."""
    model, logits, _, tokens = runs
    fp32_model = model.with_config(compute_dtype="float32")
    wrong = jax.jit(lambda m, t: llama_in_bf16(m, t, **{mistake: BF16}))(fp32_model, tokens)
    assert np.abs(np.asarray(wrong) - logits).max() > 2 * TOL
