"""Mamba-2 as a layer kind of the stack (`linear.kind = "mamba2"`): a stack of Mamba-2 layers
alone (the `mamba2` family) and a hybrid of Mamba-2 and attention layers.

The family contract (tests/test_families.py, entry `mamba2`) checks logits against transformers
both ways, peft's LoRA, scanned == unrolled, cached decoding and greedy generation
(tests/test_mamba2_generation.py: the engine). Here: the one stack of a model without
attention, packed documents equal each alone, the FLOPs count against the weights, the
validation of the group, the refusals, muP roles, and a Mamba-2 hybrid.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.nn import Linear, Mamba2, param_info
from eqllm.sharding.rules import logical_axes
from tests.families import TINY_CONFIGS
from tests.hf_parity import logits
from tests.test_segments import assert_each_document_alone, forward, packed_row

CONFIG = TINY_CONFIGS["mamba2"]  # two Mamba-2 layers, no attention, no MLP


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CONFIG, key=jax.random.key(0))


def test_a_stack_without_attention_is_one_stack_of_mixers_alone(model):
    assert CONFIG.layer_kinds() == ("linear", "linear") and CONFIG.linear.pure
    assert model.linear_blocks is None  # every layer is in `blocks`
    block = model.blocks
    assert isinstance(block.attn, Mamba2) and block.mlp is None and block.mlp_norm is None
    assert block.attn.A_log.shape == (2, 8)  # two layers of 8 heads
    axes = logical_axes(model)
    assert axes["blocks.attn.x_proj.weight"] == ("layers", "heads", "d_model")
    assert axes["blocks.attn.B_proj.weight"] == ("layers", "kv_heads", "d_model")
    assert axes["blocks.attn.out_proj.weight"] == ("layers", "d_model", "heads")


def test_packed_documents_have_their_logits_alone(model):
    """Segment ids reset the SSM state and its convolution at each boundary."""
    tokens, segments, positions = packed_row(2)
    logits_ = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segments)))
    assert_each_document_alone(model, logits_, tokens)


def test_flops_count_the_projections_and_the_head(model):
    """6 x (every projection's weights + the tied head); no attention term without attention."""
    weights = [
        leaf.weight.size
        for leaf in jax.tree.leaves(model.blocks, is_leaf=lambda x: isinstance(x, Linear))
        if isinstance(leaf, Linear)
    ]
    head = CONFIG.vocab_size * CONFIG.d_model
    assert CONFIG.flops_per_token() == 6.0 * (sum(weights) + head)
    assert CONFIG.attention_flops_per_token() == 0.0


def test_mup_gives_the_mixer_s_matrices_their_width_roles(model):
    infos = param_info(model.blocks.attn)
    assert {infos.x_proj.weight.role, infos.B_proj.weight.role, infos.out_proj.weight.role} == {
        "hidden"
    }
    assert infos.A_log.role == infos.D.role == infos.conv_weight.role == "vector"
    mup = CONFIG.replace(parametrization="mup", base_d_model=CONFIG.d_model)
    tokens = np.arange(24) % 97
    same = eqllm.CausalLM(mup, key=jax.random.key(0))  # at its base width muP is SP
    np.testing.assert_allclose(logits(same, tokens), logits(model, tokens), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear": {"kind": "gated_deltanet"}}, "full_every=None must be set for kind"),
        ({"linear": {"full_every": 1}}, "must be at least 2"),
        ({"linear": {"dt_min": 0.5, "dt_max": 0.1}}, "must be greater than dt_min=0.5"),
        ({"linear": {"n_key_heads": 3}}, "must divide n_value_heads=8"),
    ],
)
def test_the_group_is_validated(change, message):
    with pytest.raises(ConfigError, match=message):
        CONFIG.replace(**change)
    hybrid = TINY_CONFIGS["qwen3_5"]
    with pytest.raises(ConfigError, match="dt_max=0.1 is Mamba-2's time-step limit"):
        hybrid.replace(linear={"dt_max": 0.1})


@pytest.mark.slow
def test_a_hybrid_of_mamba2_and_attention_layers_runs_in_groups():
    """Mamba-2 layers with MLPs between attention layers: the groups scan, as Gated DeltaNet's
    hybrids do (Nemotron-H and Granite 4.0-H lay their layers out so)."""
    config = CONFIG.replace(
        n_layers=4,
        attention={"n_heads": 4},
        mlp={"d_ff": 64},
        linear={"full_every": 2, "mlp": True},
    )
    hybrid = eqllm.CausalLM(config, key=jax.random.key(1))
    assert config.layer_kinds() == ("linear", "full", "linear", "full")
    assert isinstance(hybrid.linear_blocks.attn, Mamba2) and hybrid.linear_blocks.mlp is not None
    tokens = np.arange(40) % 97
    scanned = logits(hybrid, tokens)
    unrolled = logits(hybrid.with_config(scan_layers=False), tokens)
    np.testing.assert_allclose(unrolled, scanned, atol=1e-5, rtol=0)
    grads = eqx.filter_grad(lambda m: m(jnp.asarray(tokens)).mean())(hybrid)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    "written, limit",
    [
        ([0.0, {"__float__": "Infinity"}], None),  # transformers 5's own writing of infinity
        ([0.0, "Infinity"], None),
        ([0.0, float("inf")], None),
        ([0.001, 100.0], 100.0),
    ],
)
def test_time_step_limit_reads_as_config_json_writes_it(written, limit):
    hf = {**eqllm.hub.to_hf_config(CONFIG), "time_step_limit": written}
    cfg = eqllm.hub.from_hf_config(hf)
    assert cfg.linear.dt_max == limit and cfg.linear.dt_min == written[0]
    assert eqllm.hub.from_hf_config(eqllm.hub.to_hf_config(cfg)) == cfg


def test_config_json_it_cannot_compute_is_refused():
    hf = eqllm.hub.to_hf_config(CONFIG)
    with pytest.raises(ConfigError, match="use_bias=True is not supported"):
        eqllm.hub.from_hf_config({**hf, "use_bias": True})
    with pytest.raises(ConfigError, match="must equal num_heads \\* head_dim"):
        eqllm.hub.from_hf_config({**hf, "expand": 3})
    with pytest.raises(ConfigError, match="no Hugging Face equivalent"):
        eqllm.hub.to_hf_config(CONFIG.replace(linear={"n_value_heads": 6}))  # inner 48 = 1.5 x 32
