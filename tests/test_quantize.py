"""int8 weights (`eqllm.quantize`) and bfloat16 weights against fp32, for every family.

Tolerances, measured on these tiny models with weights drawn at std 0.2 (logits of a few
units): the largest logit error of int8 or bf16 weights stays below 6% of the largest |logit|
for the dense families; mixtures of experts are excluded from that bound because a slightly
different router score can pick another expert. Every family is checked exactly against the
same model with its linear weights and vocabulary table replaced by the dequantized int8 values.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.hub.model_folder import with_param_dtype
from eqllm.nn import Embedding, Int8Embedding, Int8Linear, Linear, quantize
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


def _dequantized(q):
    """`q` with every `Int8Linear` and `Int8Embedding` replaced by its plain layer holding the
    dequantized weight."""

    def plain(x):
        if isinstance(x, Int8Embedding):
            table = Embedding.__new__(Embedding)
            object.__setattr__(table, "weight", x.weight * x.scale[:, None])
            object.__setattr__(table, "axes", x.axes)
            return table
        if not isinstance(x, Int8Linear):
            return x
        layer = Linear.__new__(Linear)  # any leading `layers` axes: not through __init__
        for name, value in (("weight", x.weight * x.scale[..., None]), ("bias", x.bias)):
            object.__setattr__(layer, name, value)
        object.__setattr__(layer, "axes", x.axes)
        object.__setattr__(layer, "init", x.init)
        return layer

    return jax.tree.map(plain, q, is_leaf=lambda x: isinstance(x, Int8Linear | Int8Embedding))


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

    assert isinstance(q.embed, Int8Embedding) and q.embed.weight.dtype == jnp.int8
    reference = _dequantized(q)
    np.testing.assert_allclose(_logits(q), _logits(reference), atol=1e-4, rtol=1e-4)
    # every array, the scales included, carries its metadata (sharding walks it)
    infos = jax.tree.leaves(eqllm.nn.param_info(q), is_leaf=eqllm.nn.params.is_param_info)
    assert len(infos) == len(jax.tree.leaves(q))
    assert all(isinstance(i, eqllm.nn.ParamInfo) for i in infos)


# gemma2 ties its head to the embedding, llama has its own head
@pytest.mark.parametrize("family", params({"llama", "gemma2"}, where=lambda t: t.name in DENSE))
def test_int8_and_bf16_logits_are_close_to_fp32(family):
    model = _model(family)
    want = _logits(model)
    scale = float(jnp.max(jnp.abs(want)))
    for lighter in (quantize(model, "int8"), with_param_dtype(model, "bfloat16")):
        got = _logits(lighter)
        assert float(jnp.max(jnp.abs(got - want))) < RELATIVE_TOLERANCE * scale


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # its own head; tied to the embedding
def test_quantized_model_generates_and_refuses_unknown_kinds(family):
    model = quantize(_model(family), "int8")
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


def test_int8_embedding_rounds_each_row_for_lookup_and_head():
    table = Embedding(97, 48, axes=("vocab", "d_model"), key=jax.random.key(0))
    q = Int8Embedding(table)
    assert q.weight.dtype == jnp.int8 and q.scale.shape == (97,)
    w = np.asarray(table.weight)
    scale = np.abs(w).max(axis=1) / 127
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    dequantized = np.asarray(q.weight) * scale[:, None]
    assert np.all(np.abs(dequantized - w) <= scale[:, None] / 2 + 1e-7)
    ids = jnp.asarray([[3, 0, 96], [5, 5, 1]])
    np.testing.assert_allclose(q(ids), dequantized[np.asarray(ids)], rtol=1e-6, atol=1e-7)
    x = jax.random.normal(jax.random.key(1), (2, 4, 48))
    head = q.attend(x, preferred_element_type=jnp.float32)
    assert head.shape == (2, 4, 97) and head.dtype == jnp.float32
    np.testing.assert_allclose(head, np.asarray(x) @ dequantized.T, rtol=1e-5, atol=1e-5)
    info = eqllm.nn.param_info(q)
    assert info.weight.axes == ("vocab", "d_model") and info.scale.axes == ("vocab",)


def test_int8_model_bytes():
    """smollm-135m quantized: one byte per linear and embedding weight, four per scale (one per
    output channel or row) and per norm weight: 135,439,104 bytes against 538,060,032 in fp32."""
    d, ff, kv, layers, vocab = 576, 1536, 192, 30, 49152
    linear = 2 * d * d + 2 * kv * d + 3 * d * ff  # q, o; k, v; gate, up, down
    channels = 2 * d + 2 * kv + 2 * ff + d
    norms = layers * 2 * d + d
    want = layers * linear + vocab * d + 4 * (layers * channels + vocab) + 4 * norms
    fp32 = 4 * (layers * linear + vocab * d + norms)

    def shapes(kind):
        model = eqllm.zoo.create("smollm-135m", key=jax.random.key(0))
        return model if kind is None else quantize(model, kind)

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    assert nbytes(jax.eval_shape(lambda: shapes(None))) == fp32 == 538_060_032
    assert nbytes(jax.eval_shape(lambda: shapes("int8"))) == want == 135_439_104


def test_one_row_reads_the_int8_weight_without_a_widened_copy():
    """At one row (batch-1 decode) the product and the tied head read int8 directly: the
    compiled program holds no fp32 copy of any weight (before: each layer's widened weight,
    3.5 MB per MLP weight of smollm-135m, written and read back at every token)."""
    d, ff, vocab = 256, 1024, 4096
    keys = jax.random.split(jax.random.key(0), 4)
    layers = [Int8Linear(Linear(d, ff, axes=("d_ff", "d_model"), key=k)) for k in keys[:3]]
    table = Int8Embedding(Embedding(vocab, d, axes=("vocab", "d_model"), key=keys[3]))

    def forward(layers, table, x):
        for layer in layers:
            x = x + layer(x)[..., :d]
        return table.attend(x, preferred_element_type=jnp.float32)

    x = jax.random.normal(jax.random.key(1), (1, 1, d))
    batched = jax.jit(jax.vmap(forward, in_axes=(None, None, 0)))
    np.testing.assert_allclose(
        batched(layers, table, x),
        forward(_dequantized(layers), _dequantized(table), x),
        rtol=1e-4,
        atol=1e-4,
    )
    temps = batched.lower(layers, table, x).compile().memory_analysis().temp_size_in_bytes
    assert temps < ff * d, temps  # a quarter of one layer's weight widened to fp32
