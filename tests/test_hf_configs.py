"""Real config.json files, as published, read as the zoo's sizes; metadata keys by rule.

tests/data/hf_configs/ holds the config.json of the published model each zoo size mirrors
(SOURCES.json names the Hub repository and, for a file copied from a public copy, where that
copy is; PROVENANCE.md says the same in words). Each must load to its zoo entry with the
parameter count transformers gives the same config.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

import eqllm
from eqllm.families.base import CONFIG_BOOKKEEPING, GENERATION_KEYS, is_metadata

DATA = Path(__file__).parent / "data" / "hf_configs"
SOURCES = json.loads((DATA / "SOURCES.json").read_text())


def _published(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def test_every_published_zoo_size_has_its_config_json():
    published = {n for n in eqllm.zoo.names() if eqllm.zoo.entry(n).source}
    assert published == set(SOURCES)


def test_every_fixture_says_where_it_comes_from():
    provenance = (DATA / "PROVENANCE.md").read_text()
    for name, source in SOURCES.items():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", source["hub"]), name
        assert re.search(rf"^- (\S+, )*{re.escape(name)}[:,]", provenance, re.M), name
        copy = source.get("copied_from")
        if copy:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", copy["repo"]), name
            assert re.fullmatch(r"[0-9a-f]{40}", copy["commit"]), name
            assert f"{copy['repo']}@{copy['commit']} {copy['path']}" in provenance, name


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_published_config_json_reads_as_its_zoo_size(name):
    cfg = eqllm.hub.from_hf_config(_published(name))
    assert eqllm.hub.zoo_match(cfg) == name


def _as_transformers_reads_it(hf: dict) -> dict:
    """`hf` with the first Phi-3 128K release's rope_scaling type "su" spelled "longrope": the
    installed transformers' Phi3Config checks a longrope's settings before it renames "su", and
    refuses that file. Same factors, same model; eqllm reads the file as published. Kimi K2's
    model_type "kimi_k2" is one transformers does not know: its release names
    DeepseekV3ForCausalLM and says to read it as "deepseek_v3". Llama 4 Scout's text_config has
    attn_temperature_tuning 4, which transformers 4.51 read as true and the installed strict
    Llama4TextConfig refuses (it takes a bool): the same switch, on. state-spaces' Mamba-2
    releases ship mamba_ssm's own config.json, which transformers reads only through its
    conversion script: hidden_size, layers, tied head and the vocabulary padded to
    pad_vocab_size_multiple from the file, one group, Mamba2Config's defaults for the rest."""
    if "ssm_cfg" in hf and "model_type" not in hf:
        vocab, multiple = hf["vocab_size"], hf["pad_vocab_size_multiple"]
        return {
            "model_type": "mamba2",
            "hidden_size": hf["d_model"],
            "num_heads": hf["d_model"] * 2 // 64,
            "num_hidden_layers": hf["n_layer"],
            "n_groups": 1,
            "tie_word_embeddings": hf["tie_embeddings"],
            "vocab_size": vocab + (multiple - vocab % multiple) % multiple,
        }
    text = hf.get("text_config") or {}
    if not isinstance(text.get("attn_temperature_tuning", False), bool):
        text = {**text, "attn_temperature_tuning": bool(text["attn_temperature_tuning"])}
        return {**hf, "text_config": text}
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("type") == "su":
        return {**hf, "rope_scaling": {**scaling, "type": "longrope"}}
    if hf["model_type"] == "kimi_k2":
        return {**hf, "model_type": "deepseek_v3"}
    return hf


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_published_config_json_has_transformers_parameter_count(name):
    hf = _published(name)
    config = transformers.AutoConfig.for_model(**_as_transformers_reads_it(hf))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        if type(model).__name__.endswith("ForConditionalGeneration"):  # Gemma 4: text only
            model = transformers.AutoModelForCausalLM.from_config(config.get_text_config())
    expected = sum(p.numel() for p in model.parameters())
    # DeepSeek-V3's router correction biases and Gemma 4's layer scalars are checkpoint buffers,
    # counted in DeepSeek-V3's published total (671,026,419,200) as eqllm counts them.
    stored = ("_correction_bias", ".layer_scalar")
    expected += sum(b.numel() for n, b in model.named_buffers() if n.endswith(stored))
    assert eqllm.zoo.param_count(eqllm.hub.from_hf_config(hf)) == expected
    assert eqllm.zoo.param_count(name) == expected


def _rms_norm_sizes() -> list[str]:
    types = {name: _as_transformers_reads_it(_published(name))["model_type"] for name in SOURCES}
    classes = {name: transformers.AutoConfig.for_model(kind) for name, kind in types.items()}
    return sorted(name for name, config in classes.items() if hasattr(config, "rms_norm_eps"))


@pytest.mark.parametrize("name", _rms_norm_sizes())
def test_config_json_without_rms_norm_eps_reads_transformers_default(name):
    """A config.json may leave `rms_norm_eps` to its config class (OLMoE-1B-7B-0924's does), whose
    default is 1e-5 for some families and 1e-6 for others."""
    hf = {k: v for k, v in _published(name).items() if k != "rms_norm_eps"}
    default = transformers.AutoConfig.for_model(
        _as_transformers_reads_it(hf)["model_type"]
    ).rms_norm_eps
    assert eqllm.hub.from_hf_config(hf).norms.eps == default


def test_bookkeeping_covers_transformers_pretrained_config():
    """Every field transformers' PretrainedConfig defines for all models is metadata."""
    fields = {f.name for f in dataclasses.fields(transformers.PretrainedConfig)}
    written = set(transformers.PretrainedConfig().to_dict())
    assert (fields | written) - {"model_type"} <= CONFIG_BOOKKEEPING | {"_name_or_path"}
    assert all(is_metadata(k) for k in fields | written)


def test_generation_keys_are_transformers_generation_config():
    defaults = set(transformers.GenerationConfig._get_default_generation_params())
    written = set(transformers.GenerationConfig().to_dict())
    token_ids = {k for k in defaults | written if k.endswith("_token_id")}
    ours = (defaults | written) - token_ids - {"_from_model_config", "transformers_version"}
    ours -= {"output_attentions", "output_hidden_states"}  # bookkeeping too
    assert ours == GENERATION_KEYS


@pytest.mark.parametrize(
    "key, value",
    [
        ("unk_token_id", 0),
        ("_model_name_or_path", "org/model"),
        ("_attn_implementation_autoset", True),
        ("temperature", 0.7),
        ("max_new_tokens", 256),
        ("torchscript", False),
        ("problem_type", None),
        ("image_token_ids", [5, 6]),
        ("output_past", True),
        ("pruned_heads", {}),
    ],
)
def test_metadata_keys_are_accepted(key, value):
    hf = {**_published("smollm2-135m"), key: value}
    assert eqllm.hub.zoo_match(eqllm.hub.from_hf_config(hf)) == "smollm2-135m"


@pytest.mark.parametrize(
    "key, value",
    [
        ("partial_rotary_factor", 0.5),
        ("attn_logit_softcapping", 30.0),
        ("layer_norm_type", "rms"),
        ("quantization_config", {"bits": 4}),
    ],
)
def test_architecture_keys_are_refused(key, value):
    hf = {**_published("smollm2-135m"), key: value}
    with pytest.raises(eqllm.ConfigError, match=f"does not understand: \\['{key}'\\]"):
        eqllm.hub.from_hf_config(hf)


@pytest.mark.parametrize(
    "key, value",
    [("lm_head_bias", True), ("mlp_bias", True), ("full_attn_mod", 2), ("interpolate_factor", 2)],
)
def test_phi4_remote_code_settings_are_read_only_at_plain_values(key, value):
    """Phi-4-mini's config.json names settings of its remote code that transformers' Phi3
    ignores; eqllm reads them where both compute the same model and refuses anything else."""
    hf = _published("phi4-mini")
    assert eqllm.hub.zoo_match(eqllm.hub.from_hf_config(hf)) == "phi4-mini"
    with pytest.raises(eqllm.ConfigError, match=f"config.json {key}={value!r} is not supported"):
        eqllm.hub.from_hf_config({**hf, key: value})


def test_long_context_phi_sizes_carry_their_published_longrope_factors():
    """48 factors each, one per rotated frequency (Phi-3 rotates all 96 dims of a head,
    Phi-4-mini 96 of 128), read from config.json as published; the release's "su" is LongRoPE."""
    for name in ("phi3-mini-128k", "phi3.5-mini", "phi4-mini"):
        cfg, hf = eqllm.zoo.config(name), _published(name)
        scaling = cfg.positions.scaling
        assert scaling.kind == "longrope" and scaling.original_max_seq_len == 4096
        assert list(scaling.long_factor) == hf["rope_scaling"]["long_factor"]
        assert list(scaling.short_factor) == hf["rope_scaling"]["short_factor"]
        assert len(scaling.long_factor) == cfg.rotary_dim // 2 == 48
    assert _published("phi3-mini-128k")["rope_scaling"]["type"] == "su"


def test_pruned_heads_are_refused():
    """transformers 4 writes an empty `pruned_heads` into full config dumps (accepted above);
    heads actually pruned would change the model."""
    hf = {**_published("smollm2-135m"), "pruned_heads": {"0": [1, 2]}}
    with pytest.raises(eqllm.ConfigError, match=r"pruned_heads=\{'0': \[1, 2\]\} is not supp"):
        eqllm.hub.from_hf_config(hf)


def test_interleaved_rope_is_refused():
    hf = {**_published("smollm2-135m"), "rope_interleaved": True}
    with pytest.raises(eqllm.ConfigError, match="rope_interleaved=True"):
        eqllm.hub.from_hf_config(hf)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_layer_idx": [9, 18, 27]}, r"attn_layer_idx=\[9, 18, 27\] is not supported"),
        ({"d_intermediate": 512}, "d_intermediate=512 is not supported"),
        ({"ssm_cfg": {"layer": "Mamba1"}}, "ssm_cfg.layer='Mamba1' is not supported"),
        ({"ssm_cfg": {"layer": "Mamba2", "rmsnorm": False}}, r"\['ssm_cfg.rmsnorm'\]"),
        ({"norm_before_gate": True}, r"\['norm_before_gate'\]"),
    ],
)
def test_mamba_ssm_config_json_beyond_mamba2_layers_alone_is_refused(change, message):
    """state-spaces' mamba_ssm config.json reads as a mamba2 model only where it is one:
    mamba2attn's attention layers, MLPs, Mamba-1 layers and unknown settings are refused."""
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config({**_published("mamba2-130m"), **change})


def test_mamba_ssm_config_json_reads_its_layer_settings():
    """ssm_cfg's sizes, where a mamba_ssm config.json sets them, replace mamba_ssm's defaults."""
    layer = {"layer": "Mamba2", "d_state": 64, "headdim": 32, "ngroups": 2, "chunk_size": 128}
    cfg = eqllm.hub.from_hf_config({**_published("mamba2-130m"), "ssm_cfg": layer})
    lin = cfg.linear
    assert (lin.key_head_dim, lin.value_head_dim, lin.n_key_heads) == (64, 32, 2)
    assert (lin.n_value_heads, lin.chunk_size, cfg.vocab_size) == (48, 128, 50288)
