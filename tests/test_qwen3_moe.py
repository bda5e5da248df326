"""Qwen3-MoE beyond the family contract (tests/test_families.py: logits both ways, cached
decoding, published counts): the routing read, both expert layouts, the layout written, the
load-balancing loss and its coefficient in the training loss, the config.json settings eqllm
refuses, and the published sizes' active parameters.

The models are tests/families.py's twins: tiny random ones built by transformers itself (no
downloads), every parameter perturbed.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import eqllm
from eqllm.nn import load_balancing_loss
from eqllm.train.step import training_loss
from tests.families import params
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
qwen3_moe_modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
VOCAB = 97


@pytest.fixture(scope="module", params=params(where=lambda t: t.family == "qwen3_moe"))
def pair(request, twins):
    """A perturbed tiny Qwen3-MoE (QK-norm over heads wider than d_model / n_heads, 4 experts of
    16, 2 per token, an aux loss coefficient large enough to move the training loss; top-k
    probabilities renormalised, and in the slow set not), its saved folder and eqllm's import."""
    pair = twins(request.param)
    pair.norm = pair.model.config.moe.norm_topk_prob
    return pair


def test_import_reads_the_family_and_its_routing(pair):
    cfg = pair.model.config
    assert cfg.family == "qwen3_moe" and cfg.param_dtype == "float32"
    assert cfg.attention.qk_norm == "head" and cfg.head_dim == 16
    assert (cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.expert_d_ff) == (4, 2, 16)
    assert cfg.moe.norm_topk_prob is pair.norm and cfg.moe.shared_d_ff is None
    assert cfg.moe.aux_loss_coef == 0.1


def test_renormalising_the_top_k_changes_the_logits(pair, tmp_path):
    """norm_topk_prob is read, not assumed: the same weights under the flipped setting give
    logits off transformers'."""
    hf = json.loads((pair.folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "norm_topk_prob": not pair.norm}))
    (tmp_path / "model.safetensors").symlink_to(pair.folder / "model.safetensors")
    flipped = eqllm.hub.from_pretrained(tmp_path)
    assert flipped.config.moe.norm_topk_prob is not pair.norm
    assert np.abs(logits(flipped, TOKENS[:32]) - pair.ref[:32]).max() > 1e-3


def test_export_writes_one_tensor_per_expert(pair, tmp_path):
    """Written as published checkpoints are, with the routing settings."""
    eqllm.hub.save_pretrained(pair.model, tmp_path, max_shard_size=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names
    assert not any("gate_up_proj" in n or "shared_expert" in n for n in names)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["norm_topk_prob"] is pair.norm and saved["router_aux_loss_coef"] == 0.1


def test_both_expert_layouts_import(pair, tmp_path):
    """transformers' fused in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and
    the per-expert tensors published checkpoints hold give the same model."""
    with safe_open(pair.folder / "model.safetensors", framework="numpy") as f:
        per_expert = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in per_expert
    fused = {k: v.detach().numpy() for k, v in pair.hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    for name, weights in (("fused", fused), ("per_expert", per_expert)):
        (tmp_path / name).mkdir()
        save_file(weights, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text((pair.folder / "config.json").read_text())
        again = eqllm.hub.from_pretrained(tmp_path / name)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(pair.model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The load-balancing loss -----------------------------------------------------------------------

BATCH = np.random.default_rng(1).integers(1, VOCAB, (2, 25))


def test_aux_loss_equals_transformers_load_balancing_loss(pair):
    """On the same router logits: eqllm's loss equals transformers' load_balancing_loss_func,
    and both equal the aux_loss the transformers model reports, with and without padding."""
    model, hf = pair.model, pair.hf
    _, router_logits = model.routed(jnp.asarray(BATCH, jnp.int32))
    assert router_logits.shape == (2, 2, 25, 4)  # (layers, batch, seq, experts)
    mask = np.ones(BATCH.shape, np.int64)
    mask[1, -7:] = 0
    k = model.config.moe.experts_per_token
    with torch.no_grad():
        out = hf(torch.tensor(BATCH), attention_mask=torch.tensor(mask), output_router_logits=True)
        unmasked = hf(torch.tensor(BATCH), output_router_logits=True)
    # transformers' router logits per layer, [batch * seq, experts]: the same numbers.
    for ours, theirs in zip(router_logits, unmasked.router_logits, strict=True):
        np.testing.assert_allclose(np.asarray(ours).reshape(-1, 4), theirs.numpy(), atol=1e-5)
    as_torch = tuple(torch.tensor(np.asarray(r).reshape(-1, 4)) for r in router_logits)
    for m, reported in ((None, unmasked.aux_loss), (mask, out.aux_loss)):
        theirs = qwen3_moe_modeling.load_balancing_loss_func(
            as_torch, 4, k, None if m is None else torch.tensor(m)
        )
        ours = load_balancing_loss(router_logits, k, None if m is None else jnp.asarray(m, bool))
        np.testing.assert_allclose(float(ours), float(theirs), atol=1e-6, rtol=0)
        np.testing.assert_allclose(float(ours), float(reported), atol=1e-5, rtol=0)


def test_training_loss_adds_router_aux_loss_coef_times_the_aux_loss(pair):
    """eqllm's training loss on a batch is transformers' cross entropy of the next tokens plus
    router_aux_loss_coef (0.1 here) times the aux_loss it reports for the inputs."""
    inputs, targets = torch.tensor(BATCH[:, :-1]), torch.tensor(BATCH[:, 1:])
    with torch.no_grad():
        out = pair.hf(inputs, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    loss, parts = training_loss(pair.model, jnp.asarray(BATCH, jnp.int32))
    np.testing.assert_allclose(float(parts["aux_loss"]), float(out.aux_loss), atol=1e-5)
    np.testing.assert_allclose(float(parts["ce"]), float(ce), atol=1e-5)
    np.testing.assert_allclose(float(loss), float(ce + 0.1 * out.aux_loss), atol=1e-5)


# config.json settings -------------------------------------------------------------------------

PUBLISHED = {
    name: json.loads((Path(__file__).parent / "data" / "hf_configs" / f"{name}.json").read_text())
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b")
}


def test_both_spellings_of_the_expert_count_read_the_same():
    """Published files write num_experts; transformers 5 writes num_local_experts."""
    hf = PUBLISHED["qwen3-30b-a3b"]
    cfg = eqllm.hub.from_hf_config(hf)
    renamed = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert eqllm.hub.from_hf_config(renamed) == cfg
    assert cfg.moe.n_experts == 128 and cfg.moe.aux_loss_coef == 0.001
    with pytest.raises(eqllm.ConfigError, match="expert count twice"):
        eqllm.hub.from_hf_config({**hf, "num_local_experts": 64})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 gives layers \[0, 2, 4,"),
        ({"mlp_only_layers": [0, 47]}, r"mlp_only_layers=\[0, 47\] gives layers \[0, 47\]"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"shared_expert_intermediate_size": 768}, "shared_expert_intermediate_size"),
    ],
)
def test_settings_eqllm_cannot_express_are_refused(change, message):
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config({**PUBLISHED["qwen3-30b-a3b"], **change})


def test_trivial_sparsity_settings_are_accepted():
    """decoder_sparse_step 1 and mlp_only_layers naming no existing layer are the plain model."""
    hf = PUBLISHED["qwen3-30b-a3b"]
    cfg = eqllm.hub.from_hf_config(hf)
    for change in ({"decoder_sparse_step": None}, {"mlp_only_layers": None}):
        assert eqllm.hub.from_hf_config({**hf, **change}) == cfg


def test_a_shared_expert_has_no_qwen3_moe_export(tmp_path):
    cfg = eqllm.zoo.config("qwen3_moe-nano", moe={"shared_d_ff": 16})
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    with pytest.raises(eqllm.ConfigError, match="no Hugging Face equivalent.*shared_d_ff"):
        eqllm.hub.save_pretrained(model, tmp_path)


# Published sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_total_and_active_parameters_equal_transformers(name):
    """Total: every parameter of transformers' model on the meta device. Active: that, less the
    routed experts a token does not reach, (n_experts - k) / n_experts of each layer's experts."""
    hf_config = transformers.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    count = sum(p.numel() for p in hf.parameters())
    experts = [layer.mlp.experts for layer in hf.model.layers]
    assert all(isinstance(e, qwen3_moe_modeling.Qwen3MoeExperts) for e in experts)
    idle = sum(sum(p.numel() for p in e.parameters()) for e in experts)
    idle = idle * (hf_config.num_experts - hf_config.num_experts_per_tok) // hf_config.num_experts
    assert eqllm.zoo.param_count(name) == count  # the published figure: tests/families.py
    assert eqllm.zoo.active_param_count(name) == count - idle
    cfg = eqllm.zoo.config(name)
    assert cfg == eqllm.hub.from_hf_config(PUBLISHED[name])
    assert cfg.moe.norm_topk_prob and cfg.moe.shared_d_ff is None


@pytest.mark.slow
def test_the_nano_trains_a_step_on_a_cpu():
    """qwen3_moe-nano: the research size's loss falls over a few steps of its own batch."""
    model = eqllm.zoo.create("qwen3_moe-nano", key=jax.random.key(0))
    assert model.config.moe.aux_loss_coef == 0.001 and model.config.moe.norm_topk_prob
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (4, 33)), jnp.int32)
    optimizer = optax.adam(3e-3)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    @eqx.filter_jit
    def step(model, state):
        (loss, _), grads = eqx.filter_value_and_grad(training_loss, has_aux=True)(model, tokens)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(5):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5
