"""Falcon-H1: attention and Mamba-2 in parallel in every layer (`linear.parallel`) with its muP
multipliers (`ModelConfig.multipliers`).

The family contract (tests/test_families.py, entries `falcon_h1` and `falcon_h1_normed`) checks
logits against transformers both ways (every multiplier away from 1), the bit-for-bit round
trip, peft's LoRA, scanned == unrolled, cached decoding and greedy generation against
transformers'; tests/test_falcon_h1_generation.py the engine. Here: the one stack with both
mixers in each block, packed documents equal each alone, the FLOPs count, the validation of the
new settings, a published config.json read as its zoo size, and the key multiplier against the
keys themselves scaled.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.nn import Attention, Linear, Mamba2
from eqllm.sharding.rules import logical_axes
from tests.families import TINY_CONFIGS
from tests.hf_parity import logits
from tests.test_segments import assert_each_document_alone, forward, packed_row

CONFIG = TINY_CONFIGS["falcon_h1"]  # two layers, attention and Mamba-2 side by side in each


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CONFIG, key=jax.random.key(0))


def test_every_layer_holds_attention_and_the_mixer_in_one_stack(model):
    assert CONFIG.layer_kinds() == ("full", "full") and not CONFIG.linear.pure
    assert model.linear_blocks is None
    block = model.blocks
    assert isinstance(block.attn, Attention) and isinstance(block.ssm, Mamba2)
    assert block.ssm.A_log.shape == (2, 8)  # two layers of 8 heads
    assert block.ssm.norm is None  # the releases' gate without a norm
    assert block.multipliers == (1.2, 0.7, 0.6)  # attention in and out, the mixer's out
    axes = logical_axes(model)
    assert axes["blocks.ssm.x_proj.weight"] == ("layers", "heads", "d_model")
    assert axes["blocks.attn.q_proj.weight"][0] == "layers"


def test_packed_documents_have_their_logits_alone(model):
    """Attention masks across documents and the mixer's state resets at each boundary."""
    tokens, segments, positions = packed_row(3)
    logits_ = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segments)))
    assert_each_document_alone(model, logits_, tokens)


def test_flops_count_both_mixers_and_the_head(model):
    """6 x (every projection's weights + the head) + attention's scores, in every layer."""
    weights = [
        leaf.weight.size
        for leaf in jax.tree.leaves(model.blocks, is_leaf=lambda x: isinstance(x, Linear))
        if isinstance(leaf, Linear)
    ]
    head = CONFIG.vocab_size * CONFIG.d_model
    expected = 6.0 * (sum(weights) + head) + CONFIG.attention_flops_per_token()
    assert CONFIG.flops_per_token() == expected
    assert CONFIG.attention_flops_per_token() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear": {"full_every": 2}}, "must be unset with parallel"),
        ({"linear": {"kind": "gated_deltanet", "gate_norm": "none"}}, "is Mamba-2's"),
        ({"multipliers": {"ssm": (1.0, 1.0)}}, "multipliers.ssm"),
    ],
)
def test_the_settings_are_validated(change, message):
    with pytest.raises(ConfigError, match=message):
        CONFIG.replace(**change)


def test_key_multiplier_equals_the_keys_scaled(model):
    """The key multiplier, applied as a factor on the softmax scale, computes what scaling the
    keys themselves computes (transformers' k_proj(x) * key_multiplier)."""
    plain = CONFIG.replace(multipliers={**CONFIG.multipliers.__dict__, "key": 1.0})
    skeleton = eqx.filter_eval_shape(eqllm.CausalLM, plain, key=jax.random.key(0))
    scaled = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
    k = scaled.blocks.attn.k_proj
    scaled = eqx.tree_at(lambda m: m.blocks.attn.k_proj.weight, scaled, k.weight * 0.8)
    tokens = np.arange(40) % 97
    np.testing.assert_allclose(logits(scaled, tokens), logits(model, tokens), atol=1e-5, rtol=0)


# Falcon-H1-0.5B's config.json as a public copy gives it (NVIDIA Megatron-Bridge's tests, a
# loaded copy whose keys are sorted; mamba_d_ssm is 24 heads x 64, as transformers requires).
FALCON_H1_05B = {
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.9375,
    "attn_layer_indices": None,
    "embedding_multiplier": 5.656854249492381,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "key_multiplier": 0.39062499999999994,
    "lm_head_multiplier": 0.0390625,
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_ssm": 1536,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 24,
    "mamba_norm_before_gate": False,
    "mamba_proj_bias": False,
    "mamba_rms_norm": False,
    "mamba_use_mlp": True,
    "max_position_embeddings": 16384,
    "mlp_bias": False,
    "mlp_multipliers": [0.8838834764831844, 0.5859375],
    "model_type": "falcon_h1",
    "num_attention_heads": 8,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "projectors_bias": False,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 100000000000.0,
    "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32784,
}


def test_published_config_reads_as_its_zoo_size_and_back():
    cfg = eqllm.hub.from_hf_config(FALCON_H1_05B)
    assert eqllm.hub.zoo_match(cfg) == "falcon-h1-0.5b"
    assert cfg.multipliers.ssm == tuple(FALCON_H1_05B["ssm_multipliers"])
    written = eqllm.hub.to_hf_config(cfg)
    # What transformers' FalconH1Config does not read (mamba_use_mlp, attn_layer_indices) or
    # what does not change the model eqllm writes as it likes.
    unread = {"torch_dtype", "initializer_range", "mamba_expand", "attn_layer_indices"}
    for key, value in FALCON_H1_05B.items():
        if key not in unread | {"mamba_use_mlp"}:
            assert written[key] == value, key
    for key, bad in (("mamba_use_mlp", False), ("attn_layer_indices", [0]), ("mlp_bias", True)):
        with pytest.raises(ConfigError, match=key):
            eqllm.hub.from_hf_config({**FALCON_H1_05B, key: bad})


@pytest.mark.slow
def test_completep_export_folds_the_branch_into_both_mixers(tmp_path):
    """CompleteP's branch multiplier scales attention's and the parallel mixer's sum: export
    folds it into o_proj and the mixer's out_proj alike, and transformers computes eqllm's
    logits (with Falcon-H1's own multipliers left in config.json)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CONFIG.replace(
        n_layers=4, parametrization="completep", base_d_model=16, base_n_layers=2, output_mult=2.0
    )
    model = eqllm.CausalLM(cfg, key=jax.random.key(3))
    eqllm.hub.save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 97, 40)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens[None])).logits[0].numpy()
    np.testing.assert_allclose(theirs, logits(model, tokens), atol=1e-5, rtol=0)
