"""Training: the compiled step, the loop, checkpoints, exact resume, signals, non-finite loss."""

import json
import math
import os
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS

from eqllm import CausalLM
from eqllm.cli import main
from eqllm.eval.evaluate import evaluate_run, heldout_of
from eqllm.recipe import OptimSpec, Recipe
from eqllm.runs import Checkpointer, RunFolder
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train import loop as loop_mod
from eqllm.train import report as report_mod
from tests.reliability.harness import make_corpus
from tests.reliability.harness import tiny_recipe as harness_recipe


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny text corpus and cache folders shared by the module's runs."""
    root = tmp_path_factory.mktemp("train")
    corpus = make_corpus(root)
    old = os.environ.get("EQLLM_CACHE")
    os.environ["EQLLM_CACHE"] = str(root / "cache")
    yield root, corpus
    if old is None:
        os.environ.pop("EQLLM_CACHE")
    else:
        os.environ["EQLLM_CACHE"] = old


def tiny_recipe(env, **train) -> Recipe:
    """The fault tests' tiny recipe, shorter: 8 steps, eval every 4, a checkpoint every 3."""
    root, corpus = env
    settings = {"steps": 8, "eval_every": 4, "checkpoint_every": 3, "keep_checkpoints": 5}
    return harness_recipe(root, corpus, **{**settings, **train})


def losses(out_dir):
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# The compiled step -------------------------------------------------------------------------


def make_step(grad_accum=1, lr=1e-2):
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    spec = OptimSpec(lr=lr, warmup_steps=0)
    optimizer = make_optimizer(spec, 20, eqx.filter(model, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 20), grad_accum=grad_accum)
    return step, model, init_opt_state(optimizer, model)


def test_train_step_reduces_loss_and_is_traced_once():
    step, model, opt_state = make_step()
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 17)), jnp.int32)
    seen = []
    for _ in range(8):
        model, opt_state, metrics = step(model, opt_state, batch)
        seen.append(float(metrics["loss"]))
        assert bool(metrics["finite"])
    assert seen[-1] < seen[0] - 0.5, seen
    assert step.n_traces == 1
    assert metrics["grad_norm/layer"].shape == (TINY_CONFIGS["llama"].n_layers,)
    assert math.isclose(
        float(metrics["lr"]),
        1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 20))),
        rel_tol=1e-5,
    )


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 97, (4, 17)), jnp.int32)
    step1, m1, s1 = make_step(grad_accum=1)
    step2, m2, s2 = make_step(grad_accum=2)
    _, _, met1 = step1(m1, s1, batch)
    _, _, met2 = step2(m2, s2, batch)
    assert np.allclose(met1["loss"], met2["loss"], atol=1e-6)
    assert np.allclose(met1["grad_norm"], met2["grad_norm"], rtol=1e-5)
    assert np.allclose(met1["grad_norm/layer"], met2["grad_norm/layer"], rtol=1e-5)


def test_non_finite_step_is_not_applied():
    step, model, opt_state = make_step()
    model = eqx.tree_at(lambda m: m.embed.weight, model, model.embed.weight.at[5].set(jnp.nan))
    before = [np.array(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    count_before = np.array(jax.tree.leaves(opt_state)[0])
    batch = jnp.full((4, 17), 5, jnp.int32)
    model, opt_state, metrics = step(model, opt_state, batch)
    assert not bool(metrics["finite"])
    after = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, np.asarray(b), equal_nan=True)
    assert np.array_equal(count_before, np.asarray(jax.tree.leaves(opt_state)[0]))


# The loop ----------------------------------------------------------------------------------


def test_run_writes_a_complete_run_folder(env, tmp_path):
    recipe = tiny_recipe(env, steps=8)
    result = loop_mod.run(recipe, tmp_path / "run", progress=False, echo=lambda *a: None)
    out = result.out_dir
    for name in (
        "config.toml",
        "metrics.jsonl",
        "tokenizer.json",
        "samples.txt",
        "loss.png",
        "report.md",
        "summary.json",
    ):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert Checkpointer(out / "checkpoints").latest_step() == 8
    s = result.summary
    assert s["traces"] == 1 and s["steps"] == 8 and s["tokens"] == 8 * 8 * 32
    bpt = s["val"]["bpb"] * math.log(2) / s["val"]["loss"]  # bytes/token of the val split
    assert 0.9 < 1 / bpt <= 1.0  # bytes tokenizer: one token per byte plus an eot per document
    assert 0 < s["unigram"]["bpb"] < 8
    assert set(losses(out)) == set(range(1, 9))
    assert losses(out)[8] < losses(out)[1]
    report = (out / "report.md").read_text()
    assert "bits/byte" in report and "llama-nano" in report and "MFU" in report
    # A second run into the same folder must not silently overwrite it.
    with pytest.raises(FileExistsError, match="--resume"):
        loop_mod.run(recipe, out, progress=False, echo=lambda *a: None)


def test_a_run_folder_loads_everywhere(env, tmp_path, capsys):
    """generate, eval and convert take a run folder: its last checkpoint and its tokenizer."""
    from eqllm import hub, loading

    recipe = tiny_recipe(env, steps=3)
    result = loop_mod.run(recipe, tmp_path / "run", progress=False, echo=lambda *a: None)
    out = result.out_dir
    model, tokenizer = loading.load(out)
    assert tokenizer is not None and tokenizer.kind == "bytes"
    # The loaded model is the one the run ended with: its validation loss equals the one the
    # run computed with the model in memory.
    data = loop_mod.prepare_data(recipe, progress=False)
    val = evaluate_run(model, heldout_of(data, recipe), recipe, tokenizer, samples=False)["val"]
    assert val["loss"] == result.summary["val"]["loss"]
    assert main(["convert", str(out), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--step", "99"]) == 2  # no such checkpoint: bad input
    assert "no checkpoint step 99" in capsys.readouterr().err
    exported = hub.from_pretrained(tmp_path / "hf")
    np.testing.assert_array_equal(exported.embed.weight, model.embed.weight)
    capsys.readouterr()
    args = ["generate", str(out / "checkpoints" / "3"), "--prompt", "def", "--max-new-tokens", "4"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() and "tokens in" in printed.err  # text out, with its speed


@pytest.mark.parametrize(
    "optimizer",
    [
        "adamw",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("muon", "soap", "lion", "adafactor")),
    ],
)
def test_stop_and_resume_is_bit_exact(env, tmp_path, optimizer):
    recipe = tiny_recipe(env, steps=8).replace("optim.name", optimizer)
    if optimizer == "soap":  # eigenbases refreshed at steps 2, 4, 6: across the resume too
        recipe = recipe.replace("optim.soap_precondition_frequency", 2)
    loop_mod.run(recipe, tmp_path / "a", progress=False, final_eval=False, echo=lambda *a: None)
    first = loop_mod.run(recipe, tmp_path / "b", stop_after=4, progress=False, echo=lambda *a: None)
    assert first.interrupted == "stop_after" and first.step == 4
    resumed = loop_mod.run(
        recipe, tmp_path / "b", resume=True, progress=False, final_eval=False, echo=lambda *a: None
    )
    assert resumed.step == 8
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # exact float equality
    ma, _ = RunFolder(tmp_path / "a").load_model()
    mb, _ = RunFolder(tmp_path / "b").load_model()
    for a, b in zip(
        jax.tree.leaves(eqx.filter(ma, eqx.is_array)),
        jax.tree.leaves(eqx.filter(mb, eqx.is_array)),
        strict=True,
    ):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "module, phase",
    [
        (loop_mod, "summarize"),
        pytest.param(report_mod, "evaluate_run", marks=pytest.mark.slow),
        pytest.param(report_mod, "write_report", marks=pytest.mark.slow),
    ],
    ids=["before-final-eval", "during-final-eval-and-samples", "during-report"],
)
def test_resume_at_the_last_step_finishes_the_run_folder(
    env, tmp_path, monkeypatch, capsys, module, phase
):
    """Killed after the final checkpoint (before or during the final evaluation and samples, or
    while the report is written): --resume runs no step and writes what is missing."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(tiny_recipe(env, steps=4).to_toml())
    out = tmp_path / "run"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for a kill in that phase

    monkeypatch.setattr(module, phase, killed)
    with pytest.raises(KeyboardInterrupt):
        main(["run", str(recipe), "--out", str(out), "--no-progress"])
    monkeypatch.undo()
    assert Checkpointer(out / "checkpoints").latest_step() == 4
    assert not (out / "report.md").exists()
    capsys.readouterr()
    assert main(["run", str(recipe), "--out", str(out), "--resume", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "resuming at step 4" in printed.out and "validation: loss" in printed.out
    for name in ("samples.txt", "loss.png", "report.md", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and "val" in summary and summary["samples"]
    assert summary["compile_s"] is not None and summary["final_train_loss"] is not None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "unigram/bpb" in r] == [4]  # one final evaluation row
    assert set(losses(out)) == {1, 2, 3, 4}


def _patch_step(monkeypatch, at_step, action):
    """Make the loop's train step call `action(metrics)` once the optimizer reached `at_step`."""
    original = TrainStep.__call__
    calls = {"n": 0}

    def patched(self, model, opt_state, batch):
        model, opt_state, metrics = original(self, model, opt_state, batch)
        calls["n"] += 1
        if calls["n"] == at_step:
            metrics = action(metrics)
        return model, opt_state, metrics

    monkeypatch.setattr(TrainStep, "__call__", patched)


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],
)
def test_signal_saves_a_checkpoint_and_exits_cleanly(env, tmp_path, monkeypatch, capsys, sig, code):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(tiny_recipe(env, steps=50, checkpoint_every=0).to_toml())

    def send(metrics):
        os.kill(os.getpid(), sig)
        return metrics

    _patch_step(monkeypatch, 5, send)
    out = tmp_path / "run"
    assert main(["run", str(recipe), "--out", str(out), "--no-progress"]) == code
    assert Checkpointer(out / "checkpoints").latest_step() == 5
    assert "--resume" in capsys.readouterr().out
    assert max(losses(out)) == 5


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    env, tmp_path, monkeypatch, capsys
):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(tiny_recipe(env, steps=20, checkpoint_every=3).to_toml())
    _patch_step(
        monkeypatch, 5, lambda m: {**m, "loss": jnp.float32(jnp.nan), "finite": jnp.bool_(False)}
    )
    out = tmp_path / "run"
    assert main(["run", str(recipe), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss" in err and "step 5" in err and "checkpoint is step 3" in err
    assert Checkpointer(out / "checkpoints").steps() == [3]
