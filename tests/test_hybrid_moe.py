"""Hybrid mixtures of experts: Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet and gated attention
layers, each with routed experts and a gated shared expert).

The family contract (tests/test_families.py, entries `qwen3_5_moe` and `qwen3_next`) checks the
logits against transformers both ways, peft's adapters and the published counts. Here: both
stacks carry experts with the same metadata (sharding, muP roles), the routing of every layer
reaches the balancing loss, Qwen3.5-MoE's vision-language checkpoints read as their language
model, both expert layouts import, and the dense layers transformers could give Qwen3-Next are
refused by name.
"""

import json
import logging

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import eqllm
from eqllm.config import ConfigError
from eqllm.nn.params import is_param_info
from eqllm.parametrization import roles
from eqllm.sharding.rules import logical_axes, model_param_info
from eqllm.train.balance import balance_terms
from tests.families import TINY_CONFIGS
from tests.hf_parity import hf_logits, logits

HYBRID_MOE = ["qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=HYBRID_MOE)
def model(request):
    return eqllm.CausalLM(TINY_CONFIGS[request.param], key=jax.random.key(0))


def _flat(tree) -> dict[str, object]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_param_info)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."): v for p, v in leaves}


def test_both_stacks_hold_experts_with_the_same_metadata(model):
    """A linear-attention layer's experts shard, initialise and scale (muP) as an attention
    layer's: the same logical axes (a leading `layers` axis, then `expert`) and roles."""
    axes, infos, role = logical_axes(model), _flat(model_param_info(model)), _flat(roles(model))
    mlp = sorted(p.removeprefix("blocks.") for p in axes if p.startswith("blocks.mlp."))
    assert {"mlp.router.weight", "mlp.gate.weight", "mlp.shared_gate.weight"} <= set(mlp)
    for path in mlp:
        assert axes[f"linear_blocks.{path}"] == axes[f"blocks.{path}"], path
        assert infos[f"linear_blocks.{path}"] == infos[f"blocks.{path}"], path
        assert role[f"linear_blocks.{path}"] == role[f"blocks.{path}"], path
    assert axes["linear_blocks.mlp.gate.weight"][:2] == ("layers", "expert")
    assert role["linear_blocks.attn.q_proj.weight"] == "hidden"


def test_every_layer_s_routing_reaches_the_balancing_loss(model):
    """Each of the four layers, linear and full, reports its own routing: the load is counted
    per layer (each sums to 1) and the auxiliary loss is finite."""
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)))
    _, routing = eqx.filter_jit(lambda m, t: m.routed(t))(model, tokens)
    terms = balance_terms(model, routing)
    load = np.asarray(terms["expert_load"])
    assert load.shape == (4, 4)  # layers, experts
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)
    assert len({tuple(row) for row in load}) > 1  # not one layer's routing repeated
    assert np.isfinite(float(terms["aux_loss"]))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 gives layers \[0, 2\] a dense MLP"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] gives layers \[1\] a dense MLP"),
    ],
)
def test_qwen3_next_refuses_dense_layers_by_name(change, message):
    hf = {**eqllm.hub.to_hf_config(TINY_CONFIGS["qwen3_next"]), **change}
    with pytest.raises(ConfigError, match=message + ".*Qwen3-Next has experts in every layer"):
        eqllm.hub.from_hf_config(hf)


def test_qwen3_5_moe_refuses_raw_top_k_probabilities():
    """transformers' Qwen3.5-MoE always renormalises: a file saying otherwise is refused."""
    hf = {**eqllm.hub.to_hf_config(TINY_CONFIGS["qwen3_5_moe"]), "norm_topk_prob": False}
    with pytest.raises(ConfigError, match="norm_topk_prob=False"):
        eqllm.hub.from_hf_config(hf)
    with pytest.raises(Exception, match="moe.norm_topk_prob"):
        eqllm.hub.to_hf_config(TINY_CONFIGS["qwen3_5_moe"].replace(moe={"norm_topk_prob": False}))


def test_vision_language_checkpoint_reads_as_its_language_model(tmp_path, caplog):
    """A published-style `qwen3_5_moe` folder (Qwen3_5MoeForConditionalGeneration: language
    model under `model.language_model.`, one tensor per expert, a vision tower under
    `model.visual.`) imports as the text model with transformers' logits for text, saying in
    one line what is left out."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = TINY_CONFIGS["qwen3_5_moe"]
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2}
    config = transformers.AutoConfig.for_model(
        "qwen3_5_moe",
        text_config=eqllm.hub.to_hf_config(cfg),
        vision_config={**vision, "out_hidden_size": cfg.d_model},
        tie_word_embeddings=cfg.tie_embeddings,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    with caplog.at_level(logging.WARNING, logger="eqllm.hub"):
        model = eqllm.hub.from_pretrained(tmp_path)
    assert any("left out: vision_config" in r.getMessage() for r in caplog.records)
    assert model.config.family == "qwen3_5_moe"
    tokens = np.random.default_rng(0).integers(0, 97, 40)
    np.testing.assert_allclose(logits(model, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", HYBRID_MOE)
def test_both_expert_layouts_import(twins, name, tmp_path):
    """transformers' fused in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and
    the per-expert tensors its save_pretrained writes (as published checkpoints hold them) give
    the same model, in both stacks."""
    pair = twins(name)
    with safe_open(pair.folder / "model.safetensors", framework="numpy") as f:
        per_expert = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in per_expert  # a linear layer's
    fused = {
        k: v.detach().numpy() for k, v in pair.hf.state_dict().items() if k != "lm_head.weight"
    }
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    for layout, weights in (("fused", fused), ("per_expert", per_expert)):
        (tmp_path / layout).mkdir()
        save_file(weights, tmp_path / layout / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / layout / "config.json").write_text((pair.folder / "config.json").read_text())
        again = eqllm.hub.from_pretrained(tmp_path / layout)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(pair.model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
