"""int8 weights (`eqllm.quantize`) and bfloat16 weights against fp32, for every family.

Tolerances, measured on these tiny models with weights drawn at std 0.2 (logits of a few
units): the largest logit error of int8 or bf16 weights stays below 6% of the largest |logit|
for the dense families; mixtures of experts are excluded from that bound because a slightly
different router score can pick another expert. Every family is checked exactly against the
same model with its linear weights replaced by the dequantized int8 values.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.hub.model_folder import with_param_dtype
from eqllm.nn import Int8Linear, Linear, quantize
from tests.families import TINY_CONFIGS, params

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 97, 48))
DENSE = ["gpt2", "llama", "mistral", "qwen2", "gemma", "qwen3", "gemma2", "gemma3", "phi3"]
RELATIVE_TOLERANCE = 0.06


def _model(family):
    return eqllm.CausalLM(TINY_CONFIGS[family].replace(init_std=0.2), key=jax.random.key(1))


@eqx.filter_jit
def _logits(model):
    return model(TOKENS).astype(jnp.float32)


def _is_linear(x):
    return isinstance(x, Linear)


def test_int8_linear_rounds_each_row_to_its_own_scale():
    layer = Linear(48, 16, axes=("d_ff", "d_model"), use_bias=True, key=jax.random.key(0))
    layer = eqx.tree_at(lambda m: m.weight, layer, layer.weight.at[3].set(0.0))  # scale 1
    q = Int8Linear(layer)
    assert q.weight.dtype == jnp.int8 and q.scale.shape == (16,)
    scale = np.abs(np.asarray(layer.weight)).max(axis=1) / 127
    scale[3] = 1.0
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    error = np.abs(np.asarray(q.weight) * scale[:, None] - np.asarray(layer.weight))
    assert np.all(error <= scale[:, None] / 2 + 1e-7)
    assert np.abs(np.asarray(q.weight)).max() == 127
    x = jax.random.normal(jax.random.key(1), (5, 48))
    want = x @ (np.asarray(q.weight) * scale[:, None]).T + layer.bias
    np.testing.assert_allclose(q(x), want, atol=1e-5)


@pytest.mark.parametrize("family", params({"gpt2", "qwen2_moe"}, where=lambda t: not t.variant))
def test_every_linear_is_quantized_and_equals_its_dequantized_weights(family):
    model = _model(family)
    q = quantize(model, "int8")
    linears = [x for x in jax.tree.leaves(q, is_leaf=_is_linear) if _is_linear(x)]
    assert linears and all(isinstance(x, Int8Linear) for x in linears)
    assert len(linears) == sum(_is_linear(x) for x in jax.tree.leaves(model, is_leaf=_is_linear))

    def dequantized(x):
        if not isinstance(x, Int8Linear):
            return x
        plain = Linear.__new__(Linear)  # any leading `layers` axes: not through __init__
        for name, value in (("weight", x.weight * x.scale[..., None]), ("bias", x.bias)):
            object.__setattr__(plain, name, value)
        object.__setattr__(plain, "axes", x.axes)
        object.__setattr__(plain, "init", x.init)
        return plain

    reference = jax.tree.map(dequantized, q, is_leaf=lambda x: isinstance(x, Int8Linear))
    np.testing.assert_allclose(_logits(q), _logits(reference), atol=1e-4, rtol=1e-4)
    # every array, the scales included, carries its metadata (sharding walks it)
    infos = jax.tree.leaves(eqllm.nn.param_info(q), is_leaf=eqllm.nn.linear.is_param_info)
    assert len(infos) == len(jax.tree.leaves(q))
    assert all(isinstance(i, eqllm.nn.ParamInfo) for i in infos)


@pytest.mark.parametrize("family", params({"llama", "gemma2"}, where=lambda t: t.name in DENSE))
def test_int8_and_bf16_logits_are_close_to_fp32(family):
    model = _model(family)
    want = _logits(model)
    scale = float(jnp.max(jnp.abs(want)))
    for lighter in (quantize(model, "int8"), with_param_dtype(model, "bfloat16")):
        got = _logits(lighter)
        assert float(jnp.max(jnp.abs(got - want))) < RELATIVE_TOLERANCE * scale


def _dequantized(q):
    """`q` with every `Int8Linear` replaced by a `Linear` holding its dequantized weight."""

    def plain(x):
        if not isinstance(x, Int8Linear):
            return x
        layer = Linear.__new__(Linear)  # any leading `layers` axes: not through __init__
        for name, value in (("weight", x.weight * x.scale[..., None]), ("bias", x.bias)):
            object.__setattr__(layer, name, value)
        object.__setattr__(layer, "axes", x.axes)
        object.__setattr__(layer, "init", x.init)
        return layer

    return jax.tree.map(plain, q, is_leaf=lambda x: isinstance(x, Int8Linear))


def test_quantized_model_generates_and_refuses_unknown_kinds():
    model = quantize(_model("llama"), "int8")
    out = eqllm.generate(model, [1, 2, 3], max_new_tokens=8, key=jax.random.key(0), temperature=0)
    assert out.shape == (8,)
    # the engine's steps (layers unrolled, rows under vmap) compute the dequantized model
    want = eqllm.generate(
        _dequantized(model), [1, 2, 3], max_new_tokens=8, key=jax.random.key(0), temperature=0
    )
    np.testing.assert_array_equal(out, want)
    assert eqllm.quantize is quantize
    with pytest.raises(eqllm.EqllmError, match="int4"):
        quantize(model, "int4")


def test_int8_weights_are_widened_one_layer_at_a_time():
    """Unrolled int8 layers under vmap, as the engine runs them: XLA widens each weight to
    fp32 only once its input exists, so the compiled program's temporaries hold about one
    widened weight, not every layer's (before: all of them, 406 MiB for smollm-135m's decode)."""
    d, ff, n = 256, 1024, 6
    keys = jax.random.split(jax.random.key(0), n)
    layers = [Int8Linear(Linear(d, ff, axes=("d_ff", "d_model"), key=k)) for k in keys]

    def forward(layers, x):
        for layer in layers:
            x = x + layer(x)[..., :d]
        return x

    x = jax.random.normal(jax.random.key(1), (3, 2, d))
    batched = jax.jit(jax.vmap(forward, in_axes=(None, 0)))
    np.testing.assert_allclose(batched(layers, x), forward(layers, x), rtol=1e-5, atol=1e-5)
    temps = batched.lower(layers, x).compile().memory_analysis().temp_size_in_bytes
    one_widened = ff * d * 4
    assert temps < 2.5 * one_widened, (temps, one_widened)
    grad = jax.grad(lambda x: forward(layers, x).sum())(x)  # the ordering zero has no gradient
    assert np.all(np.isfinite(np.asarray(grad)))
