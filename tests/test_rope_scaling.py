"""RoPE scaling kinds: the frequencies and attention factor of transformers' ROPE_INIT_FUNCTIONS,
and tiny models of each kind equal to transformers both ways, in the full forward and in cached
decoding (LongRoPE below and above its original context, Gemma 3's linear scaling on the global
layers only)."""

import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.nn import RopeScaling, rope_frequencies
from tests.conftest import cached_logits
from tests.hf_parity import forward, hf_logits, hf_model
from tests.test_hub import DIMS, VOCAB

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SHORT = tuple(1.0 + i / 4 for i in range(4))  # head_dim 16 at half rotary: 4 frequencies
LONG = tuple(2.0 + i for i in range(4))


LONGROPE_HF = {
    "rope_type": "longrope",
    "short_factor": [1.0 + i / 10 for i in range(16)],
    "long_factor": [2.0 + i for i in range(16)],
    "original_max_position_embeddings": 64,
}
LONGROPE = RopeScaling(
    "longrope",
    factor=256 / 64,
    original_max_seq_len=64,
    short_factor=tuple(LONGROPE_HF["short_factor"]),
    long_factor=tuple(LONGROPE_HF["long_factor"]),
)
DYNAMIC_HF = {"rope_type": "dynamic", "factor": 2.0}
DYNAMIC = RopeScaling("dynamic", factor=2.0, original_max_seq_len=256)


@pytest.mark.parametrize(
    "hf, ours, seq_len",
    [
        ({"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", factor=4.0), None),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            RopeScaling("yarn", factor=4.0, original_max_seq_len=64),
            None,
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "truncate": False,
            },
            RopeScaling(
                "yarn",
                factor=8.0,
                original_max_seq_len=4096,
                beta_fast=16.0,
                beta_slow=2.0,
                mscale=1.0,
                mscale_all_dim=0.707,
                truncate=False,
            ),
            None,
        ),
        *[(LONGROPE_HF, LONGROPE, seq_len) for seq_len in (10, 100)],
        *[(DYNAMIC_HF, DYNAMIC, seq_len) for seq_len in (None, 700)],
    ],
)
def test_frequencies_equal_transformers(hf, ours, seq_len):
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **hf},
    )
    expected, factor = ROPE_INIT_FUNCTIONS[hf["rope_type"]](config, None, seq_len=seq_len)
    inv_freq, attention = rope_frequencies(32, 10000.0, ours, seq_len)
    np.testing.assert_allclose(inv_freq, expected.double().numpy(), rtol=1e-6)
    assert attention == pytest.approx(float(factor), rel=1e-12)


LLAMA = dict(model_type="llama", **DIMS, num_key_value_heads=2)
MODELS = {
    "llama-linear": dict(**LLAMA, rope_parameters={"rope_type": "linear", "factor": 4.0}),
    "llama-yarn": dict(
        **LLAMA,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ),
    # LongRoPE with half of each head rotated: short factors up to position 64, long past it.
    "phi3-longrope": dict(
        model_type="phi3",
        **{**DIMS, "num_attention_heads": 2},
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "short_factor": list(SHORT), "long_factor": list(LONG)},
    ),
    # Phi-4-mini's layout: three quarters of each head rotated (6 of 8 dims: 3 factors),
    # grouped kv heads, tied embeddings.
    "phi4-longrope": dict(
        model_type="phi3",
        **DIMS,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        original_max_position_embeddings=64,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.25, 1.5],
            "long_factor": [2.0, 3.0, 5.0],
        },
    ),
    # Linear scaling on the global layers only; the local ones keep plain RoPE at their base.
    "gemma3-linear": dict(
        model_type="gemma3_text",
        **{**DIMS, "num_hidden_layers": 3},
        num_key_value_heads=1,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=7,
        sliding_window_pattern=2,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}
TOKENS = np.random.default_rng(1).integers(0, VOCAB, 240)


# Gemma 3's linear scaling of the global layers only runs by default; the others in the slow set.
@pytest.fixture(
    scope="module",
    params=[
        "gemma3-linear",
        *(pytest.param(m, marks=pytest.mark.slow) for m in sorted(MODELS) if m != "gemma3-linear"),
    ],
)
def pair(request, tmp_path_factory):
    name = request.param
    hf = hf_model(MODELS[name])
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return types.SimpleNamespace(name=name, hf=hf, model=eqllm.hub.from_pretrained(folder))


# LongRoPE: below and above its original 64 (the long input in the slow set)
@pytest.mark.parametrize("length", [40, pytest.param(240, marks=pytest.mark.slow)])
def test_import_and_export_equal_transformers(pair, length, tmp_path):
    tokens = TOKENS[:length]
    ref = hf_logits(pair.hf, tokens)
    np.testing.assert_allclose(np.asarray(forward(pair.model, tokens)), ref, atol=1e-4)
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(back.eval(), tokens), ref, atol=1e-5)


@pytest.mark.parametrize(
    "prefill, length", [(20, 40), pytest.param(200, 240, marks=pytest.mark.slow)]
)
def test_cached_decoding_equals_the_full_forward(pair, prefill, length):
    """Prefill, then one token at a time: each step's logits equal the full forward's."""
    tokens = jnp.asarray(TOKENS[:length])
    full = np.asarray(forward(pair.model, tokens))
    cached = cached_logits(pair.model, tokens, prefill)
    np.testing.assert_allclose(cached, full[prefill - 1 : -1], atol=1e-4)


def test_dynamic_scaling_grows_the_base_past_the_context_like_transformers(tmp_path):
    """Dynamic NTK: transformers grows the base once a sequence passes max_position_embeddings;
    eqllm's `original_max_seq_len` is that length, its own context may be longer."""
    spec = dict(
        **{**LLAMA, "max_position_embeddings": 64},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    hf = hf_model(spec)
    hf.save_pretrained(tmp_path / "hf")
    model = eqllm.hub.from_pretrained(tmp_path / "hf")
    scaling = model.config.positions.scaling
    assert scaling.kind == "dynamic" and scaling.original_max_seq_len == 64
    longer = model.config.replace(max_seq_len=256)  # the same weights over a longer context
    skeleton = eqx.filter_eval_shape(eqllm.CausalLM, longer, key=jax.random.key(0))
    model = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
    for length in (40, 240):
        tokens = TOKENS[:length]
        ref = hf_logits(hf_model(spec), tokens)  # a fresh model: transformers' cache is state
        np.testing.assert_allclose(np.asarray(forward(model, tokens)), ref, atol=1e-4)
    eqllm.hub.save_pretrained(model, tmp_path / "back")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "back").max_position_embeddings == 64


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"kind": "linear"}, "scaling.factor=None must be set for kind='linear'"),
        ({"kind": "linear", "factor": 2.0, "beta_fast": 32.0}, "beta_fast=32.0 is not used by"),
        (
            {
                "kind": "longrope",
                "original_max_seq_len": 8,
                "short_factor": [1.0],
                "long_factor": [1.0],
            },
            "short_factor=[1.0] must have one entry per rotated frequency (4)",
        ),
    ],
)
def test_scaling_settings_are_validated(scaling, message):
    with pytest.raises(eqllm.ConfigError) as info:
        eqllm.zoo.config("llama-nano", d_model=32, positions={"scaling": scaling})
    assert message in str(info.value)
