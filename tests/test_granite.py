"""Granite 4.0-H beyond the family contract (tests/families.py): the attention-only dense
layout of granite-4.0-micro/-1b/-350m, `layer_types` read as its shortest period, refusals."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import eqllm
from eqllm.families.granitemoehybrid import period

SIZES = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "mamba_n_heads": 8,  # transformers checks it divides 2 * hidden_size even without Mamba-2
}


def test_attention_only_dense_granite_has_transformers_logits(tmp_path):
    """granite-4.0-micro's layout: every layer attention with rotary positions, no experts (the
    shared MLP alone), Granite's published multipliers; no `linear` group in eqllm."""
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridConfig(
        **SIZES,
        intermediate_size=64,
        shared_intermediate_size=48,
        num_hidden_layers=3,
        num_local_experts=0,
        num_experts_per_tok=0,
        layer_types=["attention"] * 3,
        position_embedding_type="rope",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        attention_multiplier=0.0078125,
        tie_word_embeddings=True,
    )
    reference = transformers.GraniteMoeHybridForCausalLM(hf).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(tmp_path)
    assert model.config.linear is None and model.config.moe is None
    assert model.config.mlp.d_ff == 48
    tokens = np.random.default_rng(0).integers(0, 97, 20)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), expected, atol=1e-5, rtol=0)


def test_layer_types_are_kept_as_their_shortest_period():
    published = ["linear"] * 5 + ["full"] + ["linear"] * 4  # granite-4.0-h-tiny's, 4 times
    assert period(published * 4) == tuple(published)
    assert period(["linear", "full", "linear", "linear"]) == ("linear", "full", "linear")
    irregular = ["linear", "full", "linear", "linear", "full", "full"]
    assert period(irregular) == tuple(irregular)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["mamba", "mamba"]}, "has no attention layer"),
        ({"layer_types": ["mamba", "conv"]}, "layer_types"),
        ({"mamba_proj_bias": True}, "mamba_proj_bias"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ],
)
def test_what_granite_cannot_run_is_refused_by_name(change, message):
    hf = {
        **SIZES,
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 2,
        "intermediate_size": 16,
        "layer_types": ["mamba", "attention"],
        **change,
    }
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config(hf)
