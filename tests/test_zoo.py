"""The zoo registry: names, overrides, errors, and every size's parameter count against
transformers (the counts releases publish are tests/families.py's)."""

import pytest

import eqllm
from eqllm.hub import from_hf_config, to_hf_config

RESEARCH = [
    "gpt2-nano",
    "gpt2-micro",
    "gpt2-mini",
    "llama-nano",
    "llama-micro",
    "llama-mini",
    "llama-125m",
    "llama-350m",
    "gemma2-nano",
    "gemma3-nano",
    "gemma4-nano",
    "gemma4-moe-nano",
    "phi3-nano",
    "olmo2-nano",
    "olmo3-nano",
    "mixtral-nano",
    "qwen2_moe-nano",
    "olmoe-nano",
    "qwen3_moe-nano",
    "glm4_moe-nano",
    "pythia-nano",
    "smollm3-nano",
    "qwen3_5-nano",
    "qwen3_5_moe-nano",
    "qwen3_next-nano",
    "olmo_hybrid-nano",
    "llama4-nano",
    "llama4-maverick-nano",
    "mamba2-nano",
    "falcon_h1-nano",
    "granitemoehybrid-nano",
]
PUBLISHED = [
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3.1-70b",
    "llama3.1-405b",
    "llama3.2-1b",
    "llama3.2-3b",
    "tinyllama-1.1b",
    "smollm-135m",
    "smollm-360m",
    "mistral-7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "gemma-2b",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "gemma2-2b",
    "gemma2-9b",
    "gemma3-1b",
    "gemma3-4b",
    "gemma3-12b",
    "gemma3-27b",
    "gemma4-26b-a4b",
    "phi3-mini-4k",
    "phi3-mini-128k",
    "phi3.5-mini",
    "phi4-mini",
    "olmo2-1b",
    "olmo2-7b",
    "mixtral-8x7b",
    "qwen1.5-moe-a2.7b",
    "olmoe-1b-7b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "pythia-70m",
    "pythia-160m",
    "pythia-410m",
    "pythia-1b",
    "pythia-1.4b",
    "pythia-2.8b",
    "pythia-6.9b",
    "pythia-12b",
    "gpt-neox-20b",
    "smollm3-3b",
    "glm-4.5",
    "glm-4.5-air",
    "glm-4.6",
    "kimi-k2",
    "qwen3.5-35b-a3b",
    "qwen3.5-397b-a17b",
    "qwen3-next-80b-a3b",
    "llama4-scout",
    "llama4-maverick",
    "mamba2-130m",
    "mamba2-370m",
    "mamba2-780m",
    "mamba2-1.3b",
    "mamba2-2.7b",
    "mamba-codestral-7b",
    "falcon-h1-0.5b",
    "falcon-h1-1.5b",
    "falcon-h1-3b",
    "falcon-h1-7b",
    "nemotron-h-4b",
    "nemotron-h-8b",
    "nemotron-h-47b",
    "nemotron-h-56b",
    "nemotron-nano-9b-v2",
    "nemotron-nano-12b-v2",
    "granite-4.0-h-350m",
    "granite-4.0-h-1b",
    "granite-4.0-h-tiny",
    "granite-4.0-h-small",
    "granite-4.0-h-micro",
]


def test_every_promised_variant_is_in_the_zoo():
    assert set(RESEARCH + PUBLISHED) <= set(eqllm.zoo.names())


NANOS = [
    "gpt2-nano",
    "llama-nano",
    "gemma2-nano",
    "gemma3-nano",
    "gemma4-nano",
    "gemma4-moe-nano",
    "phi3-nano",
    "olmo2-nano",
    "olmo3-nano",
    "mixtral-nano",
    "qwen2_moe-nano",
    "olmoe-nano",
    "qwen3_moe-nano",
    "glm4_moe-nano",
    "pythia-nano",
    "smollm3-nano",
    "qwen3_5-nano",
    "qwen3_5_moe-nano",
    "qwen3_next-nano",
    "olmo_hybrid-nano",
    "llama4-nano",
    "llama4-maverick-nano",
    "mamba2-nano",
    "falcon_h1-nano",
    "granitemoehybrid-nano",
    "nemotron_h-moe-nano",
]


@pytest.mark.parametrize("name", NANOS)
def test_nano_is_about_a_million_parameters(name):
    assert 0.5e6 < eqllm.zoo.param_count(name) < 2.5e6


@pytest.mark.parametrize("name", ["gpt2-mini", "llama-mini"])
def test_mini_is_ten_to_twenty_million(name):
    assert 10e6 <= eqllm.zoo.param_count(name) <= 20e6


@pytest.mark.parametrize("name", sorted(set(eqllm.zoo.names())))
def test_param_count_equals_transformers(name):
    """The same architecture built by transformers on the meta device has as many parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = eqllm.zoo.config(name)
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(cfg))
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf_model.parameters())
    # DeepSeek-V3's correction biases and Gemma 4's layer scalars are checkpoint buffers; eqllm
    # counts them as arrays.
    buffers = hf_model.named_buffers()
    stored = ("_correction_bias", ".layer_scalar")
    expected += sum(b.numel() for n, b in buffers if n.endswith(stored))
    assert eqllm.zoo.param_count(name) == expected
    for special in ("bos_token_id", "eos_token_id"):  # GPT-2's 50256 is not in a small vocab
        token_id = getattr(hf_config, special, None)
        assert token_id is None or 0 <= token_id < cfg.vocab_size, (special, token_id)
    # The layer loop (scan_layers) is how eqllm runs the model, not part of the HF config.
    assert from_hf_config(hf_config.to_dict()).replace(scan_layers=cfg.scan_layers) == cfg


def test_a_dense_config_counts_every_parameter_as_active():
    """The published total and active counts of each family's sizes are tests/families.py's."""
    cfg = eqllm.zoo.config("mixtral-8x7b")
    assert eqllm.zoo.active_param_count(cfg) < eqllm.zoo.param_count(cfg)
    dense = cfg.replace(moe=None, mlp={"d_ff": cfg.expert_d_ff})
    assert eqllm.zoo.active_param_count(dense) == eqllm.zoo.param_count(dense)


@pytest.mark.parametrize("name", ["gemma2-nano", "gemma3-nano", "gemma4-nano", "phi3-nano"])
def test_research_sizes_exercise_their_family(name):
    """Windows shorter than the context, both kinds of layer, the family's own switches on."""
    cfg = eqllm.zoo.config(name)
    assert cfg.attention.sliding_window < cfg.max_seq_len
    assert (cfg.attention.global_every is None) == (name == "phi3-nano")
    assert name != "gemma2-nano" or (cfg.attention.softcap and cfg.final_softcap)
    assert name != "phi3-nano" or cfg.positions.fraction < 1
    if cfg.attention.global_every is not None:
        assert set(cfg.local_layers()) == {True, False}


def test_unknown_name_suggests_close_matches():
    with pytest.raises(eqllm.ConfigError, match="did you mean llama3-8b"):
        eqllm.zoo.config("llama3-9b")


def test_unknown_override_names_valid_fields():
    with pytest.raises(eqllm.ConfigError, match="unknown ModelConfig field.*d_modle.*d_model"):
        eqllm.zoo.config("gpt2-nano", d_modle=64)


def test_override_applies_and_validates():
    cfg = eqllm.zoo.config("llama-nano", n_layers=2)
    assert cfg.n_layers == 2 and eqllm.zoo.config("llama-nano").n_layers == 4
    with pytest.raises(eqllm.ConfigError, match="n_heads"):
        eqllm.zoo.config("llama-nano", attention={"n_heads": 5})


def test_param_count_allocates_nothing():
    """llama2-13b would need 52 GB in fp32; counting it creates no array at all."""
    import jax

    before = {id(a) for a in jax.live_arrays()}
    assert eqllm.zoo.param_count("llama2-13b") == 13_015_864_320  # the model card's count
    created = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert not created, created


def test_cli_zoo_list_and_show(capsys):
    from eqllm.cli import main

    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b" in out and "8,030,261,248" in out and "meta-llama/Meta-Llama-3-8B" in out
    assert main(["zoo", "show", "mistral-7b"]) == 0
    assert "attention.sliding_window = 4096" in capsys.readouterr().out
    assert main(["zoo", "list"]) == 0
    listed = capsys.readouterr().out
    for name in ("gemma2-9b", "gemma3-1b", "phi3-mini-4k", "olmo2-7b", "google/gemma-3-1b-pt"):
        assert name in listed
    assert main(["zoo", "show", "mistrel-7b"]) == 2
    assert "did you mean mistral-7b" in capsys.readouterr().err


def test_human_count_rounds_before_choosing_the_unit():
    assert eqllm.zoo.human_count(1_234_567) == "1.23M"
    assert eqllm.zoo.human_count(999_885_952) == "1B"  # gemma3-1b, not "1e+03M"
    assert eqllm.zoo.human_count(8_190_735_360) == "8.19B"
    assert eqllm.zoo.human_count(999) == "999"
    assert eqllm.zoo.human_count(1_026_408_232_448) == "1.03T"  # kimi-k2, not "1.03e+03B"
