"""Mixture of experts: dense == grouped experts, the layouts of expert weights on the hub, the
load-balancing loss and the gradients against transformers, training and its report.

The families' contract (logits against transformers both ways, scanned == unrolled, cached
decode == full forward) is tests/test_families.py's, over the list in tests/families.py.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import eqllm
from eqllm import CausalLM
from eqllm.config import ConfigError
from eqllm.nn import load_balancing_loss
from eqllm.recipe import OptimSpec
from eqllm.sharding import logical_axes, spec_for
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train import loop as loop_mod
from eqllm.train import report as report_mod
from eqllm.train.step import training_loss
from tests.conftest import TINY_CONFIGS
from tests.reliability.harness import make_corpus, tiny_recipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CFG = TINY_CONFIGS["qwen2_moe"]  # shared expert, top-k probabilities not renormalised
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 25)), jnp.int32)


@eqx.filter_jit
def _loss_and_grads(model, tokens):
    return eqx.filter_value_and_grad(lambda m: training_loss(m, tokens)[0])(model)


@pytest.fixture(scope="module")
def dense():
    return CausalLM(CFG.replace(moe={"aux_loss_coef": 0.1}), key=jax.random.key(0))


@pytest.mark.parametrize(
    "execution",
    [
        dict(moe={"impl": "ragged"}),
        pytest.param(dict(moe={"impl": "ragged"}, scan_layers=False), marks=pytest.mark.slow),
    ],
)
def test_grouped_experts_equal_dense_ones(dense, execution):
    """Loss and gradients of the grouped ("ragged") experts equal the dense ones, scanned and
    unrolled."""
    other = dense.with_config(**execution)
    loss, grads = _loss_and_grads(dense, TOKENS)
    other_loss, other_grads = _loss_and_grads(other, TOKENS)
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_expert_weights_carry_the_expert_axis(dense):
    axes = logical_axes(dense)
    assert axes["blocks.mlp.gate.weight"] == ("layers", "expert", "d_ff", "d_model")
    assert axes["blocks.mlp.down.weight"] == ("layers", "expert", "d_model", "d_ff")
    assert axes["blocks.mlp.router.weight"] == ("layers", None, "d_model")
    # Initialised by role like any linear layer: the down projections scaled for depth.
    std = float(jnp.std(dense.blocks.mlp.down.weight))
    assert std == pytest.approx(CFG.init_std / np.sqrt(2 * CFG.n_layers), rel=0.1)


def test_experts_split_over_the_fsdp_axis():
    """The expert axis takes fsdp; d_model, also fsdp, is then left whole (one mesh axis can
    split only one dimension). Experts that fsdp does not divide stay whole, d_model splits."""
    axes, shape = (None, "expert", "d_ff", "d_model"), (2, 4, 16, 32)
    assert spec_for(axes, shape, {"data": 1, "fsdp": 4, "tensor": 2}) == P(None, "fsdp", "tensor")
    assert spec_for(axes, shape, {"data": 1, "fsdp": 8, "tensor": 1}) == P(None, None, None, "fsdp")


def test_grouped_experts_generate_like_dense_ones(dense):
    """Generation (cached prefill and decode under vmap) runs with moe_impl='ragged' too."""
    prompt = np.asarray(TOKENS[0, :9])
    greedy = dict(max_new_tokens=6, key=jax.random.key(0), temperature=0)
    expected = eqllm.generate(dense, prompt, **greedy)
    got = eqllm.generate(dense.with_config(moe={"impl": "ragged"}), prompt, **greedy)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(moe={"n_experts": 2, "experts_per_token": 3}),
            "moe.experts_per_token=3 must be <= n_experts=2",
        ),
        (dict(moe={"shared_d_ff": 8}), "ModelConfig.moe is missing required field.s. n_experts"),
        (
            dict(moe={"n_experts": 4}, mlp={"kind": "gelu"}),
            "mlp.kind='gelu' must be 'swiglu' with moe",
        ),
        (
            dict(moe={"n_experts": 4, "branch_norms": True}),
            "moe.branch_norms=True needs a shared expert",
        ),
    ],
)
def test_bad_expert_settings_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        TINY_CONFIGS["llama"].replace(**fields)


def test_an_adapter_on_the_router_is_what_routes(dense):
    """LoRA on the router (its Hugging Face name, `gate`): the model still runs, fresh adapters
    (B = 0) change nothing, and a non-zero B changes which experts the tokens reach."""
    from eqllm import lora

    adapted = lora.apply(dense, rank=2, alpha=4, targets=["gate"], key=jax.random.key(1))
    tokens = TOKENS[0]
    np.testing.assert_array_equal(eqx.filter_jit(adapted)(tokens), eqx.filter_jit(dense)(tokens))
    b = adapted.blocks.mlp.router.lora_b.weight
    # A random B: a constant one shifts every expert's logit alike, which the softmax ignores.
    b = b + jax.random.normal(jax.random.key(2), b.shape)
    moved = eqx.tree_at(lambda m: m.blocks.mlp.router.lora_b.weight, adapted, b)

    def first(m):  # the first layer's mixture
        return jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, m.blocks.mlp)

    x = dense.embed.weight[tokens]
    before, after = first(dense).route(x)[2], first(moved).route(x)[2]
    assert (np.asarray(before) != np.asarray(after)).any(), "the adapter moved no token"
    # The experts' outputs are small at initialisation (~1e-3): compare without rtol.
    change = eqx.filter_jit(moved)(tokens) - eqx.filter_jit(dense)(tokens)
    assert np.abs(np.asarray(change)).max() > 1e-6


def test_a_dense_family_refuses_experts_on_export(tmp_path):
    model = CausalLM(TINY_CONFIGS["llama"].replace(moe={"n_experts": 4}), key=jax.random.key(0))
    with pytest.raises(ConfigError, match="n_experts"):
        eqllm.hub.save_pretrained(model, tmp_path)


# Transformers -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def hf_pair(request, twins):
    """A perturbed tiny transformers MoE (tests/families.py's), its folder, eqllm's import."""
    pair = twins(request.param)
    assert pair.hf.config.router_aux_loss_coef > 0
    return request.param, pair.hf, pair.folder, pair.model


def test_both_expert_layouts_import(hf_pair, tmp_path):
    """transformers 5's fused experts and per-expert tensors (as published checkpoints hold
    them, written here by hand) give the same model."""
    name, hf, folder, model = hf_pair
    fused = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    per_expert = {}
    moe, names = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if name == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    for key, value in fused.items():
        layer = key.split(".mlp.")[0]
        if key.endswith("experts.gate_up_proj"):
            gate, up = np.split(value, 2, axis=1)
            for j in range(value.shape[0]):
                per_expert[f"{layer}.{moe}.experts.{j}.{names[0]}.weight"] = gate[j]
                per_expert[f"{layer}.{moe}.experts.{j}.{names[1]}.weight"] = up[j]
        elif key.endswith("experts.down_proj"):
            for j in range(value.shape[0]):
                per_expert[f"{layer}.{moe}.experts.{j}.{names[2]}.weight"] = value[j]
        elif key.endswith("mlp.gate.weight"):
            per_expert[f"{layer}.{moe}.gate.weight"] = value
        else:
            per_expert[key] = value
    (tmp_path / "per_expert").mkdir()
    save_file(per_expert, tmp_path / "per_expert" / "model.safetensors")
    for layout in ("fused", "per_expert"):
        (tmp_path / layout / "config.json").write_text((folder / "config.json").read_text())
        again = eqllm.hub.from_pretrained(tmp_path / layout)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_aux_loss_equals_transformers_with_padding(hf_pair):
    _, hf, _, model = hf_pair
    mask = np.ones(TOKENS.shape, np.int64)
    mask[1, -7:] = 0  # padding at the end: the real tokens' router logits do not see it
    with torch.no_grad():
        out = hf(
            torch.tensor(np.asarray(TOKENS)),
            attention_mask=torch.tensor(mask),
            output_router_logits=True,
        )
    _, router_logits = model.routed(TOKENS)
    k = model.config.moe.experts_per_token
    ours = load_balancing_loss(router_logits, k, jnp.asarray(mask, bool))
    np.testing.assert_allclose(float(ours), float(out.aux_loss), atol=1e-5, rtol=0)
    with torch.no_grad():
        unmasked = hf(torch.tensor(np.asarray(TOKENS)), output_router_logits=True).aux_loss
    np.testing.assert_allclose(
        float(load_balancing_loss(router_logits, k)), float(unmasked), atol=1e-5
    )


def test_gradients_equal_torch_autograd(hf_pair, tmp_path):
    """d(cross entropy + coef * aux loss) by jax.grad equals torch's autograd, parameter by
    parameter (torch's gradients written as a checkpoint and imported like weights)."""
    _, hf, folder, model = hf_pair
    # No padding id 0: transformers' embedding gives its row no gradient (padding_idx).
    tokens = np.asarray(TOKENS).astype(np.int64) % 96 + 1
    hf.zero_grad()
    out = hf(torch.tensor(tokens[:, :-1]), output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), torch.tensor(tokens[:, 1:]).flatten()
    )
    total = ce + hf.config.router_aux_loss_coef * out.aux_loss
    total.backward()
    grads_as_weights = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32
    )
    with torch.no_grad():
        for p, g in zip(grads_as_weights.parameters(), hf.parameters(), strict=True):
            p.copy_(g.grad)
    grads_as_weights.save_pretrained(tmp_path)
    expected = eqllm.hub.from_pretrained(tmp_path)
    loss, grads = _loss_and_grads(model, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(float(loss), total.item(), atol=1e-5)
    paths = jax.tree_util.tree_flatten_with_path(eqx.filter(grads, eqx.is_array))[0]
    for (path, got), want in zip(paths, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=jax.tree_util.keystr(path))


# Training -----------------------------------------------------------------------------------


def test_train_step_logs_aux_loss_and_expert_load(dense):
    spec = OptimSpec(lr=1e-2, warmup_steps=0)
    optimizer = make_optimizer(spec, 10, eqx.filter(dense, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 10), grad_accum=2)
    model, opt_state = dense, init_opt_state(optimizer, dense)
    batch = jnp.concatenate([TOKENS, TOKENS[::-1]])
    first = None
    for _ in range(3):
        model, opt_state, metrics = step(model, opt_state, batch)
        first = first or float(metrics["loss"])
    load = np.asarray(metrics["expert_load"])
    assert load.shape == (CFG.n_layers, CFG.moe.n_experts)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)
    assert 0.5 < float(metrics["aux_loss"]) < CFG.moe.n_experts
    assert float(metrics["loss"]) < first


def test_the_report_draws_the_expert_load(tmp_path):
    rows = [
        {"step": s, "tokens": 64 * s, "loss": 3.0, "expert_load": [[0.5, 0.25, 0.25]] * 2}
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_mod.write_expert_load_plot(tmp_path) == tmp_path / "expert_load.png"
    (tmp_path / "dense").mkdir()  # a dense model's rows have no expert load: no plot
    (tmp_path / "dense" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}))
    assert report_mod.write_expert_load_plot(tmp_path / "dense") is None


@pytest.mark.slow
def test_a_run_logs_and_draws_the_expert_load(tmp_path):
    corpus = make_corpus(tmp_path)
    recipe = tiny_recipe(tmp_path, corpus, steps=4, eval_every=4, checkpoint_every=4)
    recipe = recipe.replace("model.variant", "olmoe-nano")
    recipe = recipe.replace("model.overrides.moe.n_experts", 4)
    out = loop_mod.run(recipe, tmp_path / "run", progress=False, echo=lambda *a: None).out_dir
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "grad_norm" in r]
    assert len(train) == 4 and all(r["aux_loss"] > 0 for r in train)
    load = np.asarray(train[-1]["expert_load"])
    assert load.shape == (2, 4)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)
    assert (out / "expert_load.png").is_file()
    assert "![expert load](expert_load.png)" in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())  # moe.impl "auto" on CPU: dense
    assert summary["experts"] == {
        "impl": "dense",
        "why": "auto on cpu: dense experts are fastest there (grouped matmul is masked)",
        "requested": "auto",
    }
    assert "moe_dropped" not in summary
    assert json.loads((out / "model_config.json").read_text())["moe"]["impl"] == "auto"
    assert 'computed by moe.impl = "dense" (auto on cpu' in (out / "report.md").read_text()
