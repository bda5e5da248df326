"""Nemotron 3's mixtures of experts in Nemotron-H (`nemotron_h` with `moe`): ungated
squared-ReLU experts (`moe.activation` "relu2") and shared expert, routed as DeepSeek-V3 routes.

The family contract runs the tiny entry `nemotron_h_moe` (tests/families.py, slow set: logits
against transformers both ways, peft both ways, scanned == unrolled, cached decoding == the full
forward, greedy == transformers' `generate`). Here: the layer against a NumPy transcription of
transformers' NemotronHMoE in each of its three computations, the stacks the kinds build, the
routing metrics of a training step, packed documents alone, the FLOPs against the weights,
config.json's spellings and refusals, and Nemotron 3 Nano's counts against transformers'.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.nn import MLP, ExpertLinear, Linear, MoE
from eqllm.recipe import OptimSpec
from eqllm.sharding.rules import logical_axes
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from tests.families import TINY_CONFIGS
from tests.test_segments import assert_each_document_alone, forward, packed_row

CONFIG = TINY_CONFIGS["nemotron_h_moe"]  # Mamba-2, experts, attention, experts, Mamba-2
FIXTURE = Path(__file__).parent / "data" / "hf_configs" / "nemotron-3-nano-30b-a3b.json"
# Nemotron 3's routing on 8 experts in 2 groups: sigmoid scores, correction bias, group limit.
ROUTING = dict(
    activation="relu2",
    scoring="sigmoid",
    score_bias=True,
    n_groups=2,
    topk_groups=1,
    group_score="top2_sum",
    routed_scale=2.5,
    shared_d_ff=20,
    shared_gated=False,
)


def _perturbed(tree, key):
    """Random values on every array (the correction bias too), so that no routing ties."""
    leaves, treedef = jax.tree.flatten(eqx.filter(tree, eqx.is_inexact_array))
    keys = jax.random.split(key, len(leaves))
    noisy = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, noisy), tree)


def _transformers_moe(moe: MoE, x: np.ndarray) -> np.ndarray:
    """NemotronHTopkRouter, NemotronHExperts and the shared NemotronHMLP, transcribed in float64
    (transformers 5.25's modeling_nemotron_h.py)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    scores = 1 / (1 + np.exp(-(x @ f64(moe.router.weight).T)))  # (T, E)
    choice = scores + f64(moe.score_bias)
    groups = choice.reshape(len(x), moe.n_groups, -1)
    group_scores = np.sort(groups, -1)[..., -2:].sum(-1)  # each group's best two
    best = np.argsort(-group_scores, -1)[:, : moe.topk_groups]
    keep = np.zeros_like(group_scores, bool)
    np.put_along_axis(keep, best, True, -1)
    choice = np.where(np.repeat(keep, groups.shape[-1], -1), choice, -np.inf)
    ids = np.argsort(-choice, -1)[:, : moe.top_k]
    weights = np.take_along_axis(scores, ids, -1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * moe.routed_scale
    up, down = f64(moe.up.weight), f64(moe.down.weight)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t], ids[t], strict=True):
            out[t] += w * (down[e] @ np.maximum(up[e] @ x[t], 0) ** 2)
    shared = np.maximum(x @ f64(moe.shared.up.weight).T, 0) ** 2 @ f64(moe.shared.down.weight).T
    return out + shared


@pytest.mark.parametrize("impl", ["dense", "ragged", "dispatch"])
def test_ungated_experts_equal_transformers_transcribed(impl):
    """The layer (output and gradients alike in its three computations) equals transformers'
    NemotronHMoE: no gate projection, relu(up)^2, the ungated shared expert added."""
    moe = _perturbed(
        MoE(16, 12, 8, 2, impl=impl, key=jax.random.key(0), **ROUTING), jax.random.key(1)
    )
    assert moe.gate is None and isinstance(moe.shared, MLP) and moe.shared.relu2
    x = jax.random.normal(jax.random.key(2), (24, 16))
    want = _transformers_moe(moe, np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(moe(x)), want, atol=1e-5, rtol=0)


def test_grouped_and_dispatched_gradients_equal_dense_ones():
    moe = _perturbed(MoE(16, 12, 8, 2, key=jax.random.key(0), **ROUTING), jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (3, 5, 16))

    @eqx.filter_jit
    def value_and_grads(moe, impl):
        return jax.value_and_grad(lambda m: (m.routed(x, impl)[0] ** 2).sum())(moe)

    loss, grads = value_and_grads(moe, "dense")
    for impl in ("ragged", "dispatch"):
        other_loss, other_grads = value_and_grads(moe, impl)
        np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return _perturbed(eqllm.CausalLM(CONFIG, key=jax.random.key(0)), jax.random.key(3))


def test_the_feed_forward_layers_are_the_experts(model):
    assert CONFIG.layer_kinds() == ("linear", "ffn", "full", "ffn", "linear")
    ffn = model.ffn_blocks
    assert ffn.attn is None and isinstance(ffn.mlp, MoE) and ffn.mlp.gate is None
    assert model.linear_blocks.mlp is None and model.blocks.mlp is None
    axes = logical_axes(model)
    assert axes["ffn_blocks.mlp.up.weight"] == ("layers", "expert", "d_ff", "d_model")
    assert axes["ffn_blocks.mlp.shared.up.weight"] == ("layers", "d_ff", "d_model")
    _, routing = eqx.filter_jit(lambda m, t: m.routing(t))(model, jnp.arange(20) % 97)
    assert routing.logits.shape == (2, 20, 8)  # the two expert layers, in layer order
    np.testing.assert_array_equal(routing.load.sum(-1), [20 * 2, 20 * 2])


@pytest.mark.slow
def test_a_training_step_logs_the_expert_load_and_moves_the_bias():
    """The balance loss and the load of each expert layer (in `ffn_blocks`, not the main
    stack) flow as in every mixture; each layer's correction bias moves by u * sign(mean load -
    load) after the step, from its own layer's load, outside the gradient."""
    u = 0.01
    cfg = CONFIG.replace(moe={"aux_loss_coef": 0.01, "bias_update_speed": u})
    model = _perturbed(eqllm.CausalLM(cfg, key=jax.random.key(0)), jax.random.key(3))
    spec = OptimSpec(lr=1e-2, warmup_steps=0)
    optimizer = make_optimizer(spec, 4, eqx.filter(model, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 4))
    tokens = np.random.default_rng(0).integers(0, 97, (4, 17))
    before = np.asarray(model.ffn_blocks.mlp.score_bias)  # the step donates the model
    new, _, metrics = step(model, init_opt_state(optimizer, model), tokens)
    load = np.asarray(metrics["expert_load"])
    assert load.shape == (2, 8)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)
    assert float(metrics["aux_loss"]) > 0
    moved = np.asarray(new.ffn_blocks.mlp.score_bias) - before
    np.testing.assert_allclose(moved, u * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)
    assert np.abs(moved).max() > 0


@pytest.mark.slow
def test_packed_documents_have_their_logits_alone(model):
    tokens, segment_ids, positions = packed_row(2)
    logits_ = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segment_ids)))
    assert_each_document_alone(model, logits_, tokens)


def test_flops_count_the_active_experts(model):
    """6 x (every linear layer's weights, the k of n experts a token reaches, the head) + the
    attention layer's scores."""
    is_layer = lambda x: isinstance(x, Linear | ExpertLinear)  # noqa: E731
    layers = [x for x in jax.tree.leaves(model, is_leaf=is_layer) if is_layer(x)]
    moe = CONFIG.moe
    weights = sum(x.weight.size for x in layers if isinstance(x, Linear))
    weights += sum(x.weight.size for x in layers if isinstance(x, ExpertLinear)) // 4  # 2 of 8
    assert moe.experts_per_token / moe.n_experts == 1 / 4
    assert CONFIG.flops_per_token() == 6.0 * weights + CONFIG.attention_flops_per_token()


def _hf(**changes):
    hf = eqllm.hub.to_hf_config(CONFIG)
    hf.pop("layers_block_type")
    return {**hf, **changes}


def test_the_symbols_and_the_names_read_the_same_experts():
    assert eqllm.hub.to_hf_config(CONFIG)["layers_block_type"][1] == "moe"
    assert eqllm.hub.from_hf_config(_hf(hybrid_override_pattern="ME*EM")) == CONFIG
    names = ["mamba", "moe", "attention", "moe", "linear_attention"]
    assert eqllm.hub.from_hf_config(_hf(layers_block_type=names)) == CONFIG


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hybrid_override_pattern": "M-*EM"}, "both 'mlp' and 'moe' layers"),
        ({"hybrid_override_pattern": "ME*EM", "moe_latent_size": 8}, "moe_latent_size"),
        ({"hybrid_override_pattern": "ME*EM", "n_shared_experts": 2}, "n_shared_experts"),
        ({"hybrid_override_pattern": "ME*EM", "mlp_bias": True}, "mlp_bias"),
    ],
)
def test_what_eqllm_does_not_build_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        eqllm.hub.from_hf_config(_hf(**changes))


def test_nemotron_3_nano_counts_equal_transformers():
    """Total: transformers' parameters and its correction-bias buffers on the meta device.
    Active: that, less the routed experts a token does not reach ((128 - 6) / 128 of each
    expert layer's)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    published = json.loads(FIXTURE.read_text())
    config = transformers.AutoConfig.for_model(**published)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in hf.parameters())
    count += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    experts = [m for m in hf.modules() if type(m).__name__ == "NemotronHExperts"]
    assert len(experts) == 23
    idle = sum(p.numel() for e in experts for p in e.parameters()) * (128 - 6) // 128
    name = "nemotron-3-nano-30b-a3b"
    assert eqllm.zoo.config(name) == eqllm.hub.from_hf_config(published)
    assert eqllm.zoo.param_count(name) == count
    assert eqllm.zoo.active_param_count(name) == count - idle
