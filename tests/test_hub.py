"""Hugging Face interop beyond the family contract: dtypes, the two config.json layouts, the zoo
match, published configs eqllm refuses, bad checkpoints named by file, tensor and field, eqllm's own
folders, load_any and the convert command.

Every family's logits against transformers both ways are tests/test_families.py's. The models
here are tiny random ones built by transformers itself (no downloads), with every parameter
perturbed so that a norm or bias mapped to the wrong place shows up in the logits.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import eqllm
from eqllm.cli import main as cli_main
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub import CheckpointError
from tests.conftest import TINY_CONFIGS
from tests.hf_parity import hf_logits, hf_model, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
LONG = 240
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
HF_CONFIGS = {
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama": dict(model_type="llama", **DIMS, num_key_value_heads=2, attention_bias=True),
    "llama3": dict(model_type="llama", **DIMS, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(model_type="qwen2", **DIMS, num_key_value_heads=1, tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, LONG)


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
    hf = hf_model(HF_CONFIGS["llama"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(tmp_path)
    assert model.config.param_dtype == model.config.compute_dtype == "bfloat16"
    expected = hf.model.layers[1].self_attn.k_proj.weight.detach().float().numpy()
    got = np.asarray(model.blocks.attn.k_proj.weight[1].astype(jnp.float32))
    np.testing.assert_array_equal(got, expected)
    as_fp32 = eqllm.hub.from_pretrained(tmp_path, dtype="float32")
    assert as_fp32.blocks.attn.k_proj.weight.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(as_fp32.blocks.attn.k_proj.weight[1]), expected)
    eqllm.hub.save_pretrained(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
        assert f.get_tensor("model.norm.weight").dtype == model.final_norm.weight.dtype


# The two config.json layouts ------------------------------------------------------------------


def test_old_and_new_rope_layouts_read_the_same():
    new = transformers.AutoConfig.for_model(**HF_CONFIGS["llama3"]).to_dict()
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    cfg = eqllm.hub.from_hf_config(new)
    assert eqllm.hub.from_hf_config(old) == cfg
    assert cfg.positions.scaling.kind == "llama3" and cfg.positions.theta == 500000.0
    assert cfg.positions.scaling.original_max_seq_len == 16


def test_zoo_variant_is_recognised():
    cfg = eqllm.zoo.config("llama3.2-1b")
    assert eqllm.hub.zoo_match(eqllm.hub.from_hf_config(eqllm.hub.to_hf_config(cfg))) == (
        "llama3.2-1b"
    )
    assert eqllm.hub.zoo_match(cfg.replace(mlp={"d_ff": cfg.mlp.d_ff + 2})) is None


# The published config.json files (tests/data/hf_configs; all of them in test_hf_configs.py).
PUBLISHED_CONFIGS = {
    name: json.loads((Path(__file__).parent / "data" / "hf_configs" / f"{name}.json").read_text())
    for name in ("gemma2-9b", "gemma3-1b", "phi3-mini-4k", "olmo2-1b")
}


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("gemma2-9b", {"layer_types": ["sliding_attention"] * 42}, "not a repeating pattern"),
        ("gemma2-9b", {"sliding_window_size": 1024}, "sliding_window_size=1024 is not supp"),
        ("gemma3-1b", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "full_attention"),
        ("gemma3-1b", {"attn_logit_softcapping": 50.0}, "transformers ignores it"),
        ("phi3-mini-4k", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "'longrope' only"),
    ],
)
def test_unsupported_new_family_settings_are_refused(name, change, message):
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config({**PUBLISHED_CONFIGS[name], **change})


def _olmo3_as_released() -> tuple[eqllm.ModelConfig, dict]:
    """An OLMo 3 config with the long-context releases' RoPE, and its config.json written as
    those releases write it (transformers 4.57): one top-level rope_theta and rope_scaling."""
    yarn = {"kind": "yarn", "factor": 8.0, "original_max_seq_len": 64, "beta_fast": 32.0}
    cfg = eqllm.zoo.config(
        "olmo3-nano",
        scan_layers=True,
        positions={"theta": 500000.0, "local_theta": 500000.0, "scaling": yarn},
    )
    hf = eqllm.hub.to_hf_config(cfg)
    rope = hf.pop("rope_parameters")["full_attention"]
    return cfg, {**hf, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}


def test_olmo3_release_layout_scales_only_the_full_attention_layers():
    transformers = pytest.importorskip("transformers")
    cfg, released = _olmo3_as_released()
    assert eqllm.hub.from_hf_config(released) == cfg
    # transformers 5 reads the file as eqllm writes it: YaRN on the full-attention layers only.
    read = transformers.AutoConfig.for_model(**released).rope_parameters
    assert read == eqllm.hub.to_hf_config(cfg)["rope_parameters"]


@pytest.mark.parametrize(
    "change, message",
    [
        # transformers 5 gives these windowed layers its default base, transformers 4 this one.
        ({"rope_theta": 10000.0}, "RoPE base ambiguous"),
        ({"rope_parameters": {"rope_type": "default"}}, "not per layer type"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "of the sliding_attention layers are not supported",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "full_attention layers"),
        ({"layer_types": ["full_attention"] + ["sliding_attention"] * 3}, "not a repeating"),
    ],
)
def test_unsupported_olmo3_settings_are_refused(change, message):
    _, released = _olmo3_as_released()
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config({**released, **change})


# Bad input: errors that name the file, tensor or field ----------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-llama-plain")
    hf_model(HF_CONFIGS["llama"]).save_pretrained(folder)
    return folder


def _copy_with(src, dst, *, config=None, tensors=None):
    """A copy of checkpoint `src` with config.json updated and tensors replaced (None drops)."""
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (dst / "config.json").write_text(json.dumps(hf))
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in (tensors or {}).items():
        if v is None:
            weights.pop(k)
        else:
            weights[k] = v
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_folder_without_config_json(tmp_path):
    with pytest.raises(CheckpointError, match=f"no config.json in {tmp_path}"):
        eqllm.hub.from_pretrained(tmp_path)


def test_uncached_repo_offline_is_named():
    with pytest.raises(CheckpointError, match="'nobody-xyz/no-such-model' .*local cache"):
        eqllm.hub.from_pretrained("nobody-xyz/no-such-model", local_files_only=True)


def test_missing_tensor_is_named(llama_folder, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _copy_with(llama_folder, tmp_path / "bad", tensors={name: None})
    with pytest.raises(CheckpointError, match=f"'{name}' is missing from model.safetensors"):
        eqllm.hub.from_pretrained(bad)


def test_wrong_shape_is_named(llama_folder, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    wrong = np.zeros((8, 32), np.float32)  # 1 kv head of 8, where config says 2
    bad = _copy_with(llama_folder, tmp_path / "bad", tensors={name: wrong})
    with pytest.raises(
        CheckpointError,
        match=rf"model.safetensors: tensor '{name}' has shape \[8, 32\].*\[16, 32\]",
    ):
        eqllm.hub.from_pretrained(bad)


def test_a_one_file_save_removes_the_shards_of_an_earlier_one(llama_folder, tmp_path):
    model = eqllm.hub.from_pretrained(llama_folder)
    eqllm.hub.save_pretrained(model, tmp_path, max_shard_size=30_000)  # sharded
    assert (tmp_path / "model.safetensors.index.json").exists()
    eqllm.hub.save_pretrained(model, tmp_path)  # one file now: the shards are removed
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_missing_shard_is_named(llama_folder, tmp_path):
    model = eqllm.hub.from_pretrained(llama_folder)
    eqllm.hub.save_pretrained(model, tmp_path, max_shard_size=30_000)
    (tmp_path / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing: \['model-00002-of-00004.safetensors'\]"):
        eqllm.hub.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(llama_folder, tmp_path):
    extra = "model.layers.0.self_attn.q_norm.weight"
    bad = _copy_with(llama_folder, tmp_path / "bad", tensors={extra: np.ones(8, np.float32)})
    with pytest.raises(CheckpointError, match=f"'{extra}' \\(model.safetensors\\)"):
        eqllm.hub.from_pretrained(bad)


def test_tied_head_that_differs_is_refused(tmp_path):
    hf = hf_model(HF_CONFIGS["qwen2"])
    hf.save_pretrained(tmp_path / "ok")
    head = np.ones((VOCAB, 32), np.float32)
    bad = _copy_with(tmp_path / "ok", tmp_path / "bad", tensors={"lm_head.weight": head})
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from the token embed"):
        eqllm.hub.from_pretrained(bad)
    with safe_open(tmp_path / "ok" / "model.safetensors", framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    same = _copy_with(tmp_path / "ok", tmp_path / "same", tensors={"lm_head.weight": embed})
    assert eqllm.hub.from_pretrained(same).lm_head is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "falcon"}, "unsupported model_type 'falcon'"),
        (
            {"rope_parameters": {"rope_type": "proportional", "factor": 4.0}},
            "rope scaling type 'proportional'",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0, "beta_fast": 3.0}},
            r"rope settings \['beta_fast'\] are not understood for rope_type 'linear'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"partial_rotary_factor": 0.5}, r"does not understand: \['partial_rotary_factor'\]"),
        ({"quantization_config": {"bits": 4}}, r"does not understand: \['quantization_config'\]"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(llama_folder, tmp_path, change, message):
    bad = _copy_with(llama_folder, tmp_path / "bad", config=change)
    with pytest.raises(eqllm.ConfigError, match=message) as info:
        eqllm.hub.from_pretrained(bad)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize(
    "change",
    [{"attention.qk_norm": "head"}, {"attention.softcap": 50.0}, {"norms.post": True}],
)
def test_unexportable_config_is_refused(tmp_path, change):
    cfg = TINY_CONFIGS["llama"].replace(**change)
    model = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    with pytest.raises(
        eqllm.ConfigError, match=f"no Hugging Face equivalent.*{next(iter(change))}"
    ):
        eqllm.hub.save_pretrained(model, tmp_path)


def test_bare_gpt2_names_load(tmp_path):
    """The original `gpt2` repo stores GPT2Model names (no 'transformer.' prefix)."""
    hf = hf_model(HF_CONFIGS["gpt2"])
    hf.save_pretrained(tmp_path / "full")
    with safe_open(tmp_path / "full" / "model.safetensors", framework="numpy") as f:
        bare = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    save_file(bare, tmp_path / "bare" / "model.safetensors", metadata={"format": "pt"})
    model = eqllm.hub.from_pretrained(tmp_path / "bare")
    tokens = TOKENS[:16]
    np.testing.assert_allclose(logits(model, tokens), hf_logits(hf, tokens), atol=1e-4)


# eqllm model folders, load_any, tokenizers and the CLI -----------------------------------------


def test_load_any_and_convert_both_ways(llama_folder, tmp_path, capsys):
    tokenizer = Tokenizer.bytes()
    hf = eqllm.hub.from_pretrained(llama_folder)
    eqllm.hub.save_pretrained(hf, tmp_path / "hf", tokenizer=tokenizer)

    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "eq")]) == 0
    assert "wrote eqllm folder" in capsys.readouterr().out
    assert (tmp_path / "eq" / "eqllm_config.json").is_file()
    model, tok = eqllm.hub.load_any(tmp_path / "eq")
    assert tok is not None and tok.encode("héllo") == tokenizer.encode("héllo")
    assert tok.eot_id == tokenizer.eot_id
    for a, b in zip(jax.tree.leaves(hf), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    assert cli_main(["convert", str(tmp_path / "eq"), str(tmp_path / "back")]) == 0
    back, tok = eqllm.hub.load_any(tmp_path / "back")
    assert back.config == hf.config and tok is not None
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert hf_tok.encode("héllo", add_special_tokens=False) == tokenizer.encode("héllo")

    zoo_model, none = eqllm.hub.load_any("llama-nano")  # a zoo name: fresh weights
    assert none is None and zoo_model.config == eqllm.zoo.config("llama-nano")
    with pytest.raises(eqllm.ConfigError, match="did you mean llama-nano"):
        eqllm.hub.load_any("llama-nanoo")


def test_eqllm_folder_keeps_any_config(tmp_path):
    """Configs with no HF counterpart still save and load as eqllm folders."""
    cfg = TINY_CONFIGS["gemma"].replace(attention={"qk_norm": "head"})
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(1))
    rng = np.random.default_rng(1)
    model = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), shapes)
    eqllm.hub.save_model(model, tmp_path)
    again = eqllm.hub.load_model(tmp_path)
    assert again.config == model.config
    assert eqx.tree_equal(again, model)


def test_convert_reports_errors_on_the_cli(tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
