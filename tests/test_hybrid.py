"""Hybrid stacks (`ModelConfig.linear`): Gated DeltaNet layers between attention layers.

The family contract (tests/test_families.py, entry `qwen3_5`) checks logits against
transformers both ways, scanned == unrolled, cached decoding == the full forward and greedy
generation == transformers'. Here: packed documents equal each document alone (the recurrent
state resets at boundaries), the layer order of the two stacks, the pattern's validation, the
refusals of what cannot carry recurrent state yet (speculative decoding, GGUF), and Qwen3.5's
vision-language checkpoints read as their language model. Generation through the engine:
tests/test_hybrid_generation.py.
"""

import json
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.errors import EqllmError
from eqllm.sharding.rules import logical_axes
from eqllm.train.step import _layer_grad_norms as layer_grad_norms
from tests.families import TINY_CONFIGS
from tests.hf_parity import hf_logits, logits
from tests.test_segments import assert_each_document_alone, forward, packed_row

CONFIG = TINY_CONFIGS["qwen3_5"]  # linear, full, linear, full


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CONFIG, key=jax.random.key(0))


def test_the_stacks_hold_each_kind_of_layer_in_order(model):
    assert CONFIG.layer_kinds() == ("linear", "full", "linear", "full")
    assert model.linear_blocks.attn.A_log.shape == (2, 4)  # two linear layers, 4 value heads
    assert model.blocks.attn.gate_proj.weight.shape == (2, 64, 32)  # two gated attention layers
    axes = logical_axes(model)
    assert axes["linear_blocks.attn.q_proj.weight"][0] == "layers"
    assert axes["blocks.attn.q_proj.weight"][0] == "layers"


def test_packed_documents_have_their_logits_alone(model):
    """Segment ids reset the Gated DeltaNet state and its convolution at each boundary."""
    tokens, segments, positions = packed_row(1)
    logits_ = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segments)))
    assert_each_document_alone(model, logits_, tokens)


def test_layer_grad_norms_follow_the_model_s_layer_order(model):
    """The per-layer gradient norms interleave the two stacks as the layers run."""
    grads = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    got = np.asarray(layer_grad_norms(grads)["grad_norm/layer"])

    def norm(stack, i):
        return np.sqrt(sum(np.sum(np.square(a[i])) for a in jax.tree.leaves(stack)))

    linear, full = (
        eqx.filter(s, eqx.is_inexact_array) for s in (grads.linear_blocks, grads.blocks)
    )
    want = [norm(linear, 0), norm(full, 0), norm(linear, 1), norm(full, 1)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert want[0] != want[1]  # the kinds differ in size: a wrong order shows


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear": {"full_every": 1}}, "must be at least 2"),
        ({"linear": {"n_key_heads": 3}}, "must divide n_value_heads=4"),
        # Dense and expert layers beside linear ones would be a fourth kind of layer.
        ({"moe": {"n_experts": 4, "sparse_every": 2}}, "sparse_every.*must be 1 in a hybrid"),
    ],
)
def test_the_pattern_is_validated(change, message):
    with pytest.raises(ConfigError, match=message):
        CONFIG.replace(**change)


def test_speculative_decoding_refuses_a_hybrid_target_or_draft_by_name(model):
    """Rejected guesses would have to be undone in the recurrent state."""
    from eqllm.generation.engine import Engine

    with pytest.raises(EqllmError, match="hybrid target .* serve it without --speculate"):
        Engine(model, max_batch=2, max_len=32, speculate=2)
    target = eqllm.CausalLM(TINY_CONFIGS["qwen3"], key=jax.random.key(1))
    with pytest.raises(EqllmError, match="hybrid draft .*qwen3_5.* cannot be rolled back"):
        Engine(target, max_batch=2, max_len=32, speculate=2, draft=model)


def test_vision_language_checkpoint_reads_as_its_language_model(tmp_path, caplog):
    """A published-style `qwen3_5` folder (Qwen3_5ForConditionalGeneration: language model under
    `model.language_model.`, a vision tower under `model.visual.`) imports as the text model,
    with the logits transformers' own model gives for text, and one line saying what is left."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text = eqllm.hub.to_hf_config(CONFIG)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2}
    config = transformers.AutoConfig.for_model(
        "qwen3_5",
        text_config=text,
        vision_config={**vision, "out_hidden_size": CONFIG.d_model},
        tie_word_embeddings=CONFIG.tie_embeddings,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    with caplog.at_level(logging.WARNING, logger="eqllm.hub"):
        model = eqllm.hub.from_pretrained(tmp_path)
    assert any("left out: vision_config" in r.getMessage() for r in caplog.records)
    assert model.config.family == "qwen3_5"
    tokens = np.random.default_rng(0).integers(0, 97, 40)
    np.testing.assert_allclose(logits(model, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_remat_recomputes_the_same_gradients(model):
    """Under a remat policy each layer of the group is checkpointed on its own."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 24)))

    def grads(m):
        return eqx.filter_grad(lambda m: m(tokens).mean())(m)

    plain = grads(model)
    for policy in ("full", "offload"):
        remat = grads(model.with_config(remat=policy))
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
