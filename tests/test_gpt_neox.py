"""GPT-NeoX / Pythia: logits equal to transformers' both ways, for the parallel and the sequential
residual; the per-head interleaved query_key_value; cached decoding; LoRA adapters in peft's
format; the zoo's published sizes.

The models are tiny random ones built by transformers itself (no downloads), every parameter
perturbed so that a norm, bias or q/k/v row mapped to the wrong place shows up in the logits.
"""

import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eqllm
from eqllm import lora
from eqllm.bench.coordcheck import activations
from eqllm.hub import from_hf_config, to_hf_config
from eqllm.nn.mlp import gelu_exact
from tests.conftest import cached_logits
from tests.hf_parity import hf_logits, hf_model, logits, saved_pair

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
LONG = 240  # hundreds of positions: short prompts miss RoPE mistakes
TOKENS = np.random.default_rng(0).integers(0, VOCAB, LONG)
DIMS = dict(
    model_type="gpt_neox",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=256,
)
HF_CONFIGS = {
    # Pythia's block: a parallel residual, a quarter of each head rotated (2 of 8 dims).
    "parallel": dict(**DIMS, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True),
    # The sequential residual; int(8 * 0.6) = 4 rotated dims (the fraction is truncated), another
    # base, another eps.
    "sequential": dict(
        **DIMS,
        rotary_pct=0.6,
        rotary_emb_base=500,
        layer_norm_eps=1e-3,
        use_parallel_residual=False,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def pair(request, tmp_path_factory):
    """A tiny transformers GPT-NeoX, its saved folder, and eqllm's import of it."""
    name = request.param
    folder = tmp_path_factory.mktemp(f"neox-{name}")
    return saved_pair(hf_model(HF_CONFIGS[name]), folder, TOKENS, name=name)


def test_import_reads_the_family_settings(pair):
    cfg = pair.model.config
    spec = HF_CONFIGS[pair.name]
    assert cfg.family == "gpt_neox" and cfg.param_dtype == "float32"
    assert cfg.parallel_residual == spec["use_parallel_residual"]
    assert cfg.rotary_dim == int(cfg.head_dim * spec["rotary_pct"])
    assert cfg.positions.theta == spec["rotary_emb_base"]
    assert cfg.mlp.gelu == "exact" and cfg.norms.kind == "layernorm" and cfg.norms.bias
    assert cfg.attention.qkv_bias and cfg.attention.out_bias and not cfg.tie_embeddings


def test_import_gives_transformers_logits(pair):
    np.testing.assert_allclose(logits(pair.model, TOKENS), pair.ref, atol=1e-5, rtol=0)


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


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["use_parallel_residual"] == (pair.name == "parallel")
    assert written["hidden_act"] == "gelu"
    assert "embed_out.weight" in load_file(tmp_path / "model.safetensors")  # published name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    exported = hf_logits(reloaded.eval(), TOKENS)
    np.testing.assert_allclose(exported, logits(pair.model, TOKENS), atol=1e-5, rtol=0)
    for name, p in pair.hf.state_dict().items():  # and the very tensors of the original
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), name)


def test_round_trip_is_bit_identical(pair, tmp_path):
    eqllm.hub.save_pretrained(pair.model, tmp_path, max_shard_size=30_000)  # sharded
    again = eqllm.hub.from_pretrained(tmp_path)
    assert again.config == pair.model.config
    for a, b in zip(jax.tree.leaves(pair.model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_in_memory_head_name_is_read_too(pair, tmp_path):
    """transformers 5 calls the output embedding lm_head in memory; a file may say so."""
    tensors = load_file(pair.folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    (tmp_path / "config.json").write_text((pair.folder / "config.json").read_text())
    renamed = eqllm.hub.from_pretrained(tmp_path)
    np.testing.assert_array_equal(logits(renamed, TOKENS), logits(pair.model, TOKENS))


def test_cached_decode_matches_full_forward(pair):
    tokens, prefill = jnp.asarray(TOKENS[:40], jnp.int32), 16
    full = logits(pair.model, tokens)
    cached = cached_logits(pair.model, tokens, prefill)
    np.testing.assert_allclose(cached, full[prefill - 1 : -1], atol=1e-5, rtol=0)


def test_greedy_equals_transformers_generate(pair):
    """eqllm.generate's greedy continuation is the one transformers' generate picks."""
    prompt, new = [int(t) for t in TOKENS[:9]], 16
    ours = eqllm.generate(
        pair.model, prompt, max_new_tokens=new, key=jax.random.key(0), temperature=0
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = pair.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out[0, len(prompt) :].tolist() == np.asarray(ours).tolist()


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


def test_peft_adapter_on_query_key_value_both_ways(pair, tmp_path):
    """eqllm's adapters saved in peft's format give peft's logits, and peft's are read back: B's
    rows follow the fused weight's per-head interleaving."""
    peft = pytest.importorskip("peft")
    targets = ["query_key_value", "dense", "dense_h_to_4h"]
    adapted = lora.apply(pair.model, rank=2, alpha=4, targets=targets, key=jax.random.key(0))
    leaves, treedef = jax.tree.flatten(adapted)
    keys = iter(jax.random.split(jax.random.key(1), len(leaves)))
    mask = jax.tree.leaves(lora.trainable(adapted))
    leaves = [
        x + 0.05 * jax.random.normal(next(keys), x.shape) if m else x
        for x, m in zip(leaves, mask, strict=True)
    ]  # every B non-zero; q, k and v with different A (a rank-6 export)
    adapted = jax.tree.unflatten(treedef, leaves)
    ours = logits(adapted, TOKENS)
    assert np.abs(ours - pair.ref).max() > 1e-3
    eqllm.hub.save_adapter(adapted, tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(pair.folder, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    assert not [w for w in caught if "keys" in str(w.message).lower()]
    np.testing.assert_allclose(hf_logits(peft_model, TOKENS), ours, atol=1e-4, rtol=0)
    again = eqllm.hub.from_pretrained(pair.folder, adapter=tmp_path)
    np.testing.assert_allclose(logits(again, TOKENS), ours, atol=1e-5, rtol=0)


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


def test_gelu_tanh_model_equals_transformers(tmp_path):
    hf = hf_model({**HF_CONFIGS["parallel"], "hidden_act": "gelu_new"})
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

PUBLISHED = {  # the counts the model cards publish
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
    "gpt-neox-20b": 20_554_567_680,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_sizes_have_the_published_and_transformers_counts(name):
    cfg = eqllm.zoo.config(name)
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(cfg))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert eqllm.zoo.param_count(name) == PUBLISHED[name]
    assert sum(p.numel() for p in hf.parameters()) == PUBLISHED[name]


def test_pythia_nano_exercises_the_family():
    cfg = eqllm.zoo.config("pythia-nano")
    assert cfg.parallel_residual and cfg.rotary_dim == cfg.head_dim // 4
    assert cfg.mlp.gelu == "exact" and not cfg.tie_embeddings
