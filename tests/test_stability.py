"""Training stability (optim.z_loss, optim.skip_spike_*, optim.ema) against closed forms, and
their exact resume."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIGS

from eqllm import CausalLM, lora
from eqllm.loading import load
from eqllm.recipe import OptimSpec, RecipeError
from eqllm.runs import RunFolder
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train import loop as loop_mod
from eqllm.train.objectives.lm import (
    LanguageModel,
    cross_entropy_and_logsumexp,
    next_token_loss,
)
from eqllm.train.stability import ema_model, ema_params
from tests.test_train import env, tiny_recipe  # noqa: F401 (the module's corpus fixture)

VOCAB = TINY_CONFIGS["llama"].vocab_size
EMA_VAL = ("ema/val/loss", "ema/val/perplexity", "ema/val/bpb")


def tiny_step(spec: OptimSpec, objective=None):
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    optimizer = make_optimizer(spec, 50, model)
    step = TrainStep(optimizer, schedule(spec, 50), objective=objective)
    return step, model, init_opt_state(optimizer, model)


def adam_count(opt_state) -> int:
    return int(optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1])


def host(tree):
    return [np.array(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


# z-loss ---------------------------------------------------------------------------------------


def test_z_loss_matches_its_closed_form_over_the_scored_tokens():
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(1))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (3, 12)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 11)) < 0.6)
    logits = np.asarray(model(tokens[:, :-1]), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    labels = np.asarray(tokens[:, 1:])
    nll = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    m = np.asarray(mask)
    ce, z = nll[m].mean(), np.square(lse[m]).mean()

    loss, parts = next_token_loss(model, tokens, mask, z_loss=1e-2)
    assert np.isclose(float(parts["ce"]), ce, rtol=1e-6)
    assert np.isclose(float(parts["z_loss"]), z, rtol=1e-6)
    assert np.isclose(float(loss), ce + 1e-2 * z, rtol=1e-6)
    plain, plain_parts = next_token_loss(model, tokens, mask)
    assert "z_loss" not in plain_parts and np.isclose(float(plain), ce, rtol=1e-6)

    # Its gradient through the cross entropy's logsumexp (the max shifted out under
    # stop_gradient) is the closed form's: 2 * z_loss * lse * softmax / tokens, per token.
    def z_term(lg):
        _, lse_ = cross_entropy_and_logsumexp(lg, tokens[:, 1:])
        return 1e-2 * jnp.sum(jnp.where(mask, jnp.square(lse_), 0.0)) / mask.sum()

    grad = jax.grad(z_term)(jnp.asarray(logits, jnp.float32))
    softmax = np.exp(logits - lse[..., None])
    expected = 2e-2 * lse[..., None] * softmax * m[..., None] / m.sum()
    assert np.allclose(np.asarray(grad), expected, atol=1e-7)


def test_the_step_reports_z_loss_and_minimises_it():
    spec = OptimSpec(lr=1e-2, warmup_steps=0, z_loss=1e-1)
    step, model, opt_state = tiny_step(spec, LanguageModel(z_loss=1e-1))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 17)), jnp.int32)
    zs = []
    for _ in range(4):
        model, opt_state, metrics = step(model, opt_state, batch)
        zs.append(float(metrics["z_loss"]))
    assert zs[-1] < zs[0], zs  # the term is in the gradient
    assert "ce" not in metrics and np.isfinite(float(metrics["loss"]))


# Skipping a spiking step ------------------------------------------------------------------------


class ScaledLoss(LanguageModel):
    """The language model's loss times the batch's "scale": a spike made to order."""

    def loss(self, model, batch):
        loss, _ = next_token_loss(model, batch["tokens"])
        return loss * batch["scale"][0], {}


def test_a_spiking_step_is_not_applied_and_a_normal_one_is():
    spec = OptimSpec(lr=1e-4, warmup_steps=0, skip_spike_window=4, skip_spike_sigma=6.0)
    step, model, opt_state = tiny_step(spec, ScaledLoss())
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 17))

    def batch(scale):
        return {"tokens": jnp.asarray(tokens, jnp.int32), "scale": jnp.full((4,), scale)}

    for _ in range(3):  # the window fills: two values are enough for it to act
        model, opt_state, metrics = step(model, opt_state, batch(1.0))
        assert not bool(metrics["spike"])
    before, count = host(model), adam_count(opt_state)
    model, opt_state, metrics = step(model, opt_state, batch(100.0))  # a fabricated spike
    assert bool(metrics["finite"]) and bool(metrics["spike"]) and int(metrics["spikes"]) == 1
    for a, b in zip(before, host(model), strict=True):
        assert np.array_equal(a, b)  # parameters unchanged, bit for bit
    assert adam_count(opt_state) == count  # the moments and the step count too
    assert int(opt_state.filled) == 4  # its values entered the window (as OLMo-core's)
    model, opt_state, metrics = step(model, opt_state, batch(1.0))
    assert not bool(metrics["spike"]) and int(metrics["spikes"]) == 1
    assert any(not np.array_equal(a, b) for a, b in zip(before, host(model), strict=True))
    assert adam_count(opt_state) == count + 1
    assert step.n_traces == 1


def test_the_spike_threshold_is_mean_plus_sigma_std_of_the_window():
    from eqllm.train.stability import SpikeState, is_spike

    history = np.array([2.0, 2.2, 1.9, 2.1, 0.0, 0.0], np.float32)
    state = SpikeState(None, jnp.asarray(history), jnp.asarray(history), 4, 4, 0, False)
    mean, std = history[:4].mean(), history[:4].std(ddof=1)
    assert not bool(is_spike(state, mean + 2.9 * std, 1.0, 3.0))
    assert bool(is_spike(state, mean + 3.1 * std, 1.0, 3.0))
    assert bool(is_spike(state, 1.0, mean + 3.1 * std, 3.0))  # the gradient norm alone
    early = state._replace(filled=jnp.asarray(2))  # under half a window of 6: never
    assert not bool(is_spike(early, 100.0, 100.0, 3.0))


# EMA of the weights -----------------------------------------------------------------------------


def test_ema_is_the_decayed_sum_of_the_parameters():
    decay = 0.8
    spec = OptimSpec(lr=1e-2, warmup_steps=0, ema=decay)
    step, model, opt_state = tiny_step(spec)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 17)), jnp.int32)
    seen = [host(model)]  # p_0, then the parameters after each step
    for _ in range(5):
        model, opt_state, metrics = step(model, opt_state, batch)
        seen.append(host(model))
    n = len(seen) - 1
    expected = [decay**n * p.astype(np.float64) for p in seen[0]]
    for t in range(1, n + 1):
        expected = [
            e + (1 - decay) * decay ** (n - t) * p for e, p in zip(expected, seen[t], strict=True)
        ]
    got = host(ema_params(opt_state))
    for e, g in zip(expected, got, strict=True):
        assert np.allclose(g, e, rtol=1e-6, atol=1e-7)
    assert not all(np.array_equal(g, p) for g, p in zip(got, seen[-1], strict=True))


def test_a_lora_run_averages_its_adapters_only():
    decay = 0.5
    spec = OptimSpec(lr=1e-2, warmup_steps=0, ema=decay)
    base = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    model = lora.apply(base, rank=2, alpha=4, targets=["q_proj", "v_proj"], key=jax.random.key(1))
    optimizer = make_optimizer(spec, 50, model)
    step = TrainStep(optimizer, schedule(spec, 50))
    opt_state = init_opt_state(optimizer, model)
    first = host(eqx.filter(model, lora.trainable(model)))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 17)), jnp.int32)
    model, opt_state, _ = step(model, opt_state, batch)
    averaged = ema_model(model, opt_state)
    trained = eqx.filter(model, lora.trainable(model))
    for e, p0, p1 in zip(
        host(eqx.filter(averaged, lora.trainable(averaged))), first, host(trained), strict=True
    ):
        assert np.allclose(e, decay * p0 + (1 - decay) * p1, rtol=1e-6, atol=1e-7)
    frozen = lambda m: host(eqx.filter(m, lora.trainable(m), inverse=True))  # noqa: E731
    for a, b in zip(frozen(averaged), frozen(model), strict=True):
        assert np.array_equal(a, b)  # the base weights are the base weights


# Recipes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"skip_spike_window": 2}, r"optim.skip_spike_window=2 is too short"),
        ({"skip_spike_sigma": 3.0}, r"optim.skip_spike_sigma=3.0 has no effect"),
        ({"ema": 1.0}, r"OptimSpec.ema=1.0"),
        ({"z_loss": -1.0}, r"OptimSpec.z_loss=-1.0"),
    ],
)
def test_stability_fields_are_validated(fields, message):
    with pytest.raises(RecipeError, match=message):
        OptimSpec(**fields)


def test_z_loss_is_refused_for_objectives_without_a_cross_entropy(env):  # noqa: F811
    recipe = tiny_recipe(env).replace("optim.z_loss", 1e-4)
    assert recipe.optim.z_loss == 1e-4
    values = recipe.to_dict()
    values["train"]["objective"] = "dpo"
    values["preference"] = {"data": "pairs.jsonl"}
    values["finetune"] = {"method": "full"}
    values["model"]["init_from"] = "some/model"
    with pytest.raises(RecipeError, match=r"optim.z_loss=0.0001 with train.objective='dpo'"):
        type(recipe).from_dict(values)


# A run ------------------------------------------------------------------------------------------


def test_a_run_with_every_tool_resumes_bit_exactly_after_a_skip(env, tmp_path, monkeypatch):  # noqa: F811
    """A fabricated spike (the 5th step's loss times 100) is skipped and counted; stopped after
    it and resumed, the run gives the same losses, weights, EMA and skips as an uninterrupted
    one."""
    batch_of, loss_of = LanguageModel.batch, LanguageModel.loss

    def batch(self, step, model=None):
        rows = batch_of(self, step, model)
        scale = 100.0 if step == 4 else 1.0
        return {**rows, "scale": np.full(len(rows["tokens"]), scale, np.float32)}

    def loss(self, model, batch):
        value, parts = loss_of(self, model, batch)
        return value * batch["scale"][0], parts

    monkeypatch.setattr(LanguageModel, "batch", batch)
    monkeypatch.setattr(LanguageModel, "loss", loss)
    recipe = tiny_recipe(env, steps=8, eval_every=4, checkpoint_every=100)
    for key, value in [
        ("optim.z_loss", 1e-3),
        ("optim.ema", 0.9),
        ("optim.skip_spike_window", 4),
        ("optim.skip_spike_sigma", 4.0),
    ]:
        recipe = recipe.replace(key, value)
    quiet = dict(progress=False, echo=lambda *a: None)
    full = loop_mod.run(recipe, tmp_path / "a", final_eval=False, **quiet)
    first = loop_mod.run(recipe, tmp_path / "b", stop_after=6, **quiet)
    assert first.step == 6
    resumed = loop_mod.run(recipe, tmp_path / "b", resume=True, **quiet)

    rows = {
        k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in "ab"
    }
    # The final evaluation (of "b" alone): the raw weights' row, then the EMA's.
    final = [r for r in rows["b"] if "unigram/bpb" in r or set(r) == {"step", "tokens", *EMA_VAL}]
    assert [r["step"] for r in final] == [8, 8]
    assert resumed.summary["ema"]["val"]["loss"] == final[1]["ema/val/loss"]
    keys = ("loss", "z_loss", "spike", "spikes", "ema/val/loss", "val/loss")
    seen = {
        k: [
            {n: r[n] for n in keys if n in r} | {"step": r["step"]}
            for r in rows[k]
            if r not in final
        ]
        for k in "ab"
    }
    seen = {k: [r for r in v if len(r) > 1] for k, v in seen.items()}  # not the compile rows
    assert seen["a"] == seen["b"]  # exact float equality, row by row
    assert [r["step"] for r in rows["a"] if "ema/val/loss" in r] == [4]
    spiked = [r["step"] for r in rows["a"] if r.get("spike")]
    assert 5 in spiked
    assert full.summary["spikes_skipped"] == resumed.summary["spikes_skipped"] == len(spiked)
    report = (tmp_path / "b" / "report.md").read_text()
    assert "EMA weights' validation loss" in report and "spiking steps skipped" in report
    for k in ("a", "b"):
        assert (tmp_path / k / RunFolder.EMA_DIR / "model.safetensors").is_file()
    ema_a, _ = load(tmp_path / "a" / RunFolder.EMA_DIR)
    ema_b, _ = load(tmp_path / "b" / RunFolder.EMA_DIR)
    raw, _ = RunFolder(tmp_path / "a").load_model()
    for x, y in zip(host(ema_a), host(ema_b), strict=True):
        assert np.array_equal(x, y)
    assert not all(np.array_equal(x, r) for x, r in zip(host(ema_a), host(raw), strict=True))
