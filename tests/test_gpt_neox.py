"""GPT-NeoX / Pythia beyond the family contract (tests/test_families.py: logits both ways,
cached decoding, LoRA in peft's format, published counts): the per-head interleaved
query_key_value, the published tensor names, the parallel and the sequential residual, the
coordinate check's walk of the block, and the config settings.

The models are tests/families.py's twins: tiny random ones built by transformers itself (no
downloads), every parameter perturbed so that a norm, bias or q/k/v row mapped to the wrong place
shows up in the logits.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eqllm
from eqllm.bench.coordcheck import activations
from eqllm.hub import from_hf_config, to_hf_config
from eqllm.nn.mlp import gelu_exact
from tests.families import params
from tests.hf_parity import TOKENS, hf_logits, hf_model, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
DIMS = dict(
    model_type="gpt_neox",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module", params=params(where=lambda t: t.family == "gpt_neox"))
def pair(request, twins):
    """A tiny transformers GPT-NeoX (the parallel residual; the sequential one in the slow set),
    its saved folder, and eqllm's import of it."""
    return twins(request.param)


def test_import_reads_the_family_settings(pair):
    cfg, hf = pair.model.config, pair.hf.config
    assert cfg.family == "gpt_neox" and cfg.param_dtype == "float32"
    assert cfg.parallel_residual == hf.use_parallel_residual
    assert cfg.rotary_dim == int(cfg.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert cfg.positions.theta == hf.rope_parameters["rope_theta"]
    assert cfg.mlp.gelu == "exact" and cfg.norms.kind == "layernorm" and cfg.norms.bias
    assert cfg.attention.qkv_bias and cfg.attention.out_bias and not cfg.tie_embeddings


def test_query_key_value_is_split_per_head(pair):
    """Row block h of the fused tensor holds head h's query, key and value, in that order."""
    cfg = pair.model.config
    heads, head_dim = cfg.attention.n_heads, cfg.head_dim
    layer = pair.hf.gpt_neox.layers[1].attention.query_key_value
    weight = layer.weight.detach().numpy().reshape(heads, 3, head_dim, cfg.d_model)
    bias = layer.bias.detach().numpy().reshape(heads, 3, head_dim)
    attn = pair.model.blocks.attn
    for part, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
        np.testing.assert_array_equal(
            np.asarray(proj.weight[1]).reshape(heads, head_dim, cfg.d_model), weight[:, part]
        )
        np.testing.assert_array_equal(
            np.asarray(proj.bias[1]).reshape(heads, head_dim), bias[:, part]
        )


def test_export_writes_the_published_names_and_settings(pair, tmp_path):
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["use_parallel_residual"] == pair.model.config.parallel_residual
    assert written["hidden_act"] == "gelu"
    assert "embed_out.weight" in load_file(tmp_path / "model.safetensors")  # published name


def test_the_in_memory_head_name_is_read_too(pair, tmp_path):
    """transformers 5 calls the output embedding lm_head in memory; a file may say so."""
    tensors = load_file(pair.folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    (tmp_path / "config.json").write_text((pair.folder / "config.json").read_text())
    renamed = eqllm.hub.from_pretrained(tmp_path)
    np.testing.assert_array_equal(logits(renamed, TOKENS), logits(pair.model, TOKENS))


def test_residual_variants_compute_different_functions(pair):
    """The switch reaches the blocks: the same weights under the other residual differ."""
    config = pair.model.config.replace(parallel_residual=not pair.model.config.parallel_residual)
    skeleton = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
    flipped = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(pair.model))
    assert flipped.blocks.parallel == config.parallel_residual
    assert np.abs(logits(flipped, TOKENS) - pair.ref).max() > 1e-3


def test_coordinate_check_walks_the_block_as_it_runs(pair):
    """eqllm coordcheck's layer walk gives the model's own logits under either residual."""
    _, walked = activations(pair.model, jnp.asarray(TOKENS[:64]))
    np.testing.assert_allclose(np.asarray(walked), logits(pair.model, TOKENS[:64]), atol=1e-5)


# Configuration -------------------------------------------------------------------------------


def test_gelu_tanh_configs_read_as_the_tanh_form():
    """GPT-NeoX-20B's gelu_fast is the tanh approximation; an unknown activation is refused."""
    hf = transformers.AutoConfig.for_model(**DIMS).to_dict()
    assert from_hf_config(hf).mlp.gelu == "exact"
    assert from_hf_config({**hf, "hidden_act": "gelu_fast"}).mlp.gelu == "tanh"
    with pytest.raises(eqllm.ConfigError, match="hidden_act='relu' is not supported"):
        from_hf_config({**hf, "hidden_act": "relu"})
    with pytest.raises(eqllm.ConfigError, match="rope scaling type 'linear'"):
        from_hf_config({**hf, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_a_rotary_fraction_is_truncated_to_whole_dims_as_transformers_does():
    """int(8 * 0.6) = 4 rotated dims of each 8-wide head, as transformers computes them."""
    hf = transformers.AutoConfig.for_model(**DIMS, rotary_pct=0.6)
    assert from_hf_config(hf.to_dict()).rotary_dim == 4


def test_gelu_tanh_model_equals_transformers(tmp_path):
    hf = hf_model({**DIMS, "rotary_pct": 0.25, "hidden_act": "gelu_new"})
    hf.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(tmp_path)
    assert model.config.mlp.gelu == "tanh"
    np.testing.assert_allclose(logits(model, TOKENS), hf_logits(hf, TOKENS), atol=1e-5, rtol=0)


def test_settings_are_validated_with_their_paths():
    with pytest.raises(eqllm.ConfigError, match=r"ModelConfig\.mlp\.gelu='exact' is only defined"):
        eqllm.zoo.config("llama-nano", mlp={"gelu": "exact"})
    with pytest.raises(eqllm.ConfigError, match=r"ModelConfig\.mlp\.gelu='erf'"):
        eqllm.zoo.config("pythia-nano", mlp={"gelu": "erf"})
    with pytest.raises(eqllm.ConfigError, match=r"ModelConfig\.parallel_residual='yes'"):
        eqllm.zoo.config("pythia-nano", parallel_residual="yes")


def test_other_families_refuse_the_new_switches_on_export():
    for change in ({"parallel_residual": True}, {"mlp": {"gelu": "exact"}}):
        with pytest.raises(eqllm.ConfigError, match="no Hugging Face equivalent"):
            to_hf_config(eqllm.zoo.config("gpt2-nano", **change))
    with pytest.raises(eqllm.ConfigError, match="no Hugging Face equivalent"):
        to_hf_config(eqllm.zoo.config("pythia-nano", attention={"n_kv_heads": 2}))


def test_exact_gelu_derivative_equals_autodiff():
    x = jnp.linspace(-6.0, 6.0, 101)
    expected = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(x)
    np.testing.assert_allclose(jax.vmap(jax.grad(gelu_exact))(x), expected, atol=1e-6)
    np.testing.assert_allclose(
        gelu_exact(x), torch.nn.functional.gelu(torch.tensor(np.asarray(x))).numpy(), atol=1e-6
    )


# The zoo -------------------------------------------------------------------------------------


def test_pythia_nano_exercises_the_family():
    cfg = eqllm.zoo.config("pythia-nano")
    assert cfg.parallel_residual and cfg.rotary_dim == cfg.head_dim // 4
    assert cfg.mlp.gelu == "exact" and not cfg.tie_embeddings
