"""Objectives (`eqllm.train.objectives`): the recipe names one; a mixture of experts' balance
terms are the same for all; a frozen reference or teacher survives full fine-tuning; GRPO checks
its prompts in its own words; distillation's loss against NumPy, its checks and exact resume."""

import json
import sys
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIGS

import eqllm
from eqllm import CausalLM
from eqllm.data import Tokenizer
from eqllm.nn import balanced_bias, expert_load
from eqllm.recipe import Recipe, RecipeError
from eqllm.train import TrainStep, init_opt_state
from eqllm.train import loop as loop_mod
from eqllm.train.guards import resume_changes
from eqllm.train.objectives import Distill, Grpo, LanguageModel, Preference, distill_kl
from tests.reliability.harness import make_corpus

QUIET = dict(progress=False, echo=lambda *a: None)


# train.objective -----------------------------------------------------------------------------


def _values(**sections):
    return {"model": {"variant": "llama-nano", "init_from": "base"}, "train": {"steps": 1},
            "finetune": {"method": "lora"}, **sections}  # fmt: skip


@pytest.mark.parametrize(
    "sections, objective",
    [
        ({"preference": {"data": "p.jsonl"}}, "dpo"),
        ({"preference": {"data": "p.jsonl", "loss": "ipo"}}, "ipo"),
        ({"rl": {"data": "r.jsonl"}, "data": {"seq_len": 64}}, "grpo"),
        ({"finetune": {"method": "lora", "data": "i.jsonl"}}, "sft"),
        ({}, "lm"),
    ],
)
def test_a_recipe_without_an_objective_names_the_one_its_data_implies(sections, objective):
    recipe = Recipe.from_dict(_values(**sections), inputs=False)
    assert recipe.train.objective == objective
    if objective in ("dpo", "ipo"):
        assert recipe.preference.loss == objective
    # Written out, the recipe names it: a run folder's config.toml says what it trained.
    assert recipe.to_dict()["train"]["objective"] == objective
    assert Recipe.from_dict(recipe.to_dict(), inputs=False) == recipe
    explicit = _values(**sections)
    explicit["train"] = {"steps": 1, "objective": objective}
    # A run folder written before train.objective resumes under a recipe that names it.
    assert resume_changes(recipe, Recipe.from_dict(explicit, inputs=False), force=False,
                          where="config.toml") == []  # fmt: skip


@pytest.mark.parametrize(
    "objective, sections, message",
    [
        ("ipo", {"preference": {"data": "p.jsonl", "loss": "dpo"}}, "disagree; train.objective"),
        ("dpo", {}, "train.objective='dpo' needs preference.data"),
        ("lm", {"rl": {"data": "r.jsonl"}}, "leave rl.data empty or set train.objective"),
        ("distill", {}, "train.objective='distill' needs distill.teacher"),
        (
            "sft",
            {"preference": {"data": "p.jsonl"}, "finetune": {"method": "lora", "data": "i.jsonl"}},
            "a run trains one objective",
        ),  # fmt: skip
    ],
)
def test_an_objective_the_sections_contradict_is_refused(objective, sections, message):
    values = _values(**sections)
    values["train"] = {"steps": 1, "objective": objective}
    with pytest.raises(RecipeError, match=message):
        Recipe.from_dict(values, inputs=False)


# A mixture of experts' balance, one rule for every objective ---------------------------------


@pytest.mark.slow  # three steps of a mixture of experts with latent attention compiled: ~1 min
def test_dpo_and_grpo_move_deepseeks_correction_bias_as_pretraining_does():
    """On a tiny DeepSeek-V3 with moe.bias_update_speed and a correction bias that changes the
    routing, one step of DPO, GRPO and the language model on the same token rows (learning rate
    0: only the bias moves) moves the bias identically: by the load of the experts the bias
    chose, not by the plain top-k load."""
    u = 0.01
    cfg = eqllm.zoo.config(
        "deepseek_v3-nano",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        max_seq_len=32,
        moe={"bias_update_speed": u},
    )
    model = CausalLM(cfg, key=jax.random.key(0))
    bias = np.zeros(model.blocks.mlp.score_bias.shape, np.float32)
    bias[:, :2] = 0.3  # experts 0 and 1 chosen far more often than the router's scores say
    model = eqx.tree_at(lambda m: m.blocks.mlp.score_bias, model, jnp.asarray(bias))
    rows = np.random.default_rng(0).integers(0, 64, (4, 13))
    mask = np.ones((4, 12), bool)
    batches = {
        "lm": (LanguageModel(), {"tokens": rows}),
        "dpo": (
            Preference("dpo", 0.1),
            {
                "tokens": rows.reshape(2, 2, 13),
                "mask": mask.reshape(2, 2, 12),
                "ref": np.zeros((2, 2), np.float32),
            },
        ),  # fmt: skip
        "grpo": (
            Grpo(max_new_tokens=12),
            {
                "tokens": rows,
                "mask": mask,
                "advantages": np.asarray([1.0, -1.0, 0.5, -0.5]),
                "rewards": np.ones(4, np.float32),
            },
        ),  # fmt: skip
    }
    moved = {}
    for name, (objective, batch) in batches.items():
        step = TrainStep(optax.sgd(0.0), lambda count: 0.0, objective=objective)
        fresh = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
        out, _, metrics = step(fresh, init_opt_state(step.optimizer, fresh), batch)
        assert "expert_load" in metrics and float(metrics["aux_loss"]) > 0
        moved[name] = np.asarray(out.blocks.mlp.score_bias)
    np.testing.assert_array_equal(moved["dpo"], moved["lm"])
    np.testing.assert_array_equal(moved["grpo"], moved["lm"])
    assert not np.array_equal(moved["lm"], bias)
    # The plain top-k load would have moved it elsewhere (the test can tell them apart).
    _, router = eqx.filter_jit(lambda m, t: m.routed(t))(model, jnp.asarray(rows[:, :-1]))
    plain = balanced_bias(jnp.asarray(bias), expert_load(router, 2)[0], u)
    assert not np.allclose(moved["lm"], np.asarray(plain))


# Frozen references and teachers under full fine-tuning ---------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama (context 64) with a byte tokenizer, its prompts, pairs and a corpus."""
    from eqllm.hub.folders import save_tokenizer

    root = tmp_path_factory.mktemp("objectives")
    model = eqllm.zoo.create(
        "llama-nano", vocab_size=257, d_model=32, n_layers=2,
        attention={"n_heads": 2, "n_kv_heads": 1}, mlp={"d_ff": 64},
        max_seq_len=64, key=jax.random.key(0),
    )  # fmt: skip
    eqllm.hub.save_pretrained(model, root / "base", tokenizer=Tokenizer.bytes())
    save_tokenizer(Tokenizer.bytes(), root / "base")
    prompts = [{"prompt": f"{n} + {n} =", "answer": str(2 * n)} for n in range(48)]
    (root / "rl.jsonl").write_text("\n".join(json.dumps(r) for r in prompts) + "\n")
    pairs = [{"prompt": f"Say {w}.", "chosen": f"{w}\n", "rejected": f"{w}{w}x\n"}
             for w in ("a", "bb", "c", "dd", "e", "ff", "g", "hh")]  # fmt: skip
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    make_corpus(root)
    return root


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drop = ("tokens_per_s", "step_s", "mfu", "compile_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in rows if "compile_s" not in r]


def test_grpo_with_full_fine_tuning_a_kl_reference_and_no_data_section(base, tmp_path, monkeypatch):
    """The recipe of the report: 48 short prompts, 8 completions of up to 24 tokens, every
    weight trained, a KL term, no [data] (data.seq_len's default, 256, is more than the model's
    context of 64: the rows take the context). The reference keeps arrays of its own: the
    step's donation of the policy leaves it readable at every later step.

    The reward is graded (the sum of the completion's bytes, modulo 7), so that every group of
    a random model's completions has advantages: with exact match, whether any of them is
    right (and the first step has a gradient) depends on the machine's rounding."""
    rewards = types.ModuleType("graded_rewards")
    rewards.byte_sum = lambda prompt, completion, example: float(sum(completion.encode()) % 7)
    monkeypatch.setitem(sys.modules, "graded_rewards", rewards)
    recipe = Recipe.from_dict(
        {
            "model": {"variant": "llama-nano", "init_from": str(base / "base")},
            "finetune": {"method": "full"},
            "rl": {"data": str(base / "rl.jsonl"), "group_size": 8, "max_new_tokens": 24,
                   "kl_coef": 0.01, "reward": "graded_rewards:byte_sum"},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "train": {"batch_size": 16, "steps": 3, "log_every": 1, "eval_every": 0,
                      "checkpoint_every": 0},
            "eval": {"sample_prompts": []},
        }
    )  # fmt: skip
    assert recipe.train.objective == "grpo" and recipe.data.seq_len == 256
    loop_mod.run(recipe, tmp_path / "run", final_eval=False, **QUIET)
    steps = [r for r in _rows(tmp_path / "run") if "loss" in r]
    assert len(steps) == 3 and all(r["grad_norm"] > 0 for r in steps)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is its reference
    assert steps[2]["kl"] > steps[0]["kl"]


def test_grpo_checks_its_prompts_against_the_context_in_its_own_words(base, tmp_path):
    recipe = Recipe.from_dict(
        {
            "model": {"variant": "llama-nano", "init_from": str(base / "base")},
            "finetune": {"method": "lora"},
            "rl": {"data": str(base / "rl.jsonl"), "group_size": 2, "max_new_tokens": 60},
            "train": {"batch_size": 4, "steps": 1},
        }
    )  # fmt: skip
    with pytest.raises(RecipeError) as info:
        loop_mod.run(recipe, tmp_path / "run", **QUIET)
    message = str(info.value)
    assert message.startswith(f"rl.data={str(base / 'rl.jsonl')!r}: the prompt ")
    assert "rl.max_new_tokens=60" in message and "the model's context 64" in message
    assert "training tokens" not in message  # no pretraining corpus check on a prompt file


@pytest.mark.slow  # a run of the loop; GRPO's above is the default suite's
def test_dpo_with_full_fine_tuning_keeps_its_reference_apart(base, tmp_path):
    recipe = Recipe.from_dict(
        {
            "model": {"variant": "llama-nano", "init_from": str(base / "base")},
            "finetune": {"method": "full"},
            "preference": {"data": str(base / "pairs.jsonl")},
            "data": {"seq_len": 48, "val_fraction": 0.25},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "train": {"batch_size": 2, "steps": 3, "log_every": 1, "eval_every": 0,
                      "checkpoint_every": 0},
            "eval": {"sample_prompts": []},
        }
    )  # fmt: skip
    loop_mod.run(recipe, tmp_path / "run", final_eval=False, **QUIET)
    steps = [r for r in _rows(tmp_path / "run") if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference
    assert len(steps) == 3 and steps[2]["loss"] != steps[0]["loss"]
    assert (tmp_path / "run" / "reference_logps.npz").is_file()


# Distillation --------------------------------------------------------------------------------


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("top_k", [0, 5], ids=["full", "top-5"])
def test_distillation_loss_equals_numpy(top_k):
    cfg = TINY_CONFIGS["llama"]
    student = CausalLM(cfg, key=jax.random.key(1))
    teacher = CausalLM(cfg, key=jax.random.key(2))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (3, 11))
    mask = np.arange(10)[None] >= rng.integers(0, 5, (3, 1))
    objective = Distill(teacher=teacher, temperature=2.0, ce_weight=0.3, top_k=top_k)
    batch = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}
    loss, parts = eqx.filter_jit(lambda o, m, b: o.loss(m, b))(objective, student, batch)

    s = np.asarray(student(jnp.asarray(tokens[:, :-1])), np.float64)
    t = np.asarray(teacher(jnp.asarray(tokens[:, :-1])), np.float64)
    log_s = _log_softmax(s / 2.0)
    if top_k:
        index = np.argsort(-t, -1)[..., :top_k]
        log_t = _log_softmax(np.take_along_axis(t / 2.0, index, -1))
        log_s = np.take_along_axis(log_s, index, -1)
    else:
        log_t = _log_softmax(t / 2.0)
    kl = (np.exp(log_t) * (log_t - log_s)).sum(-1)
    kd = 4.0 * kl[mask].mean()
    nll = -np.take_along_axis(_log_softmax(s), tokens[:, 1:, None], -1)[..., 0]
    ce = nll[mask].mean()
    # fp32 against float64 (a small KL loses digits to cancellation: an absolute bound too)
    np.testing.assert_allclose(float(parts["teacher_kl"]), kd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(parts["data_ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.7 * kd + 0.3 * ce, rtol=1e-5, atol=1e-6)
    # A student equal to its teacher: nothing to learn from the whole distribution; over the
    # top k, the mass it puts elsewhere (the target is the teacher truncated to its top k).
    same = distill_kl(jnp.asarray(s), jnp.asarray(s), temperature=2.0, top_k=top_k)
    p = np.exp(_log_softmax(s / 2.0))
    outside = -np.log(np.sort(p, -1)[..., ::-1][..., :top_k].sum(-1)) if top_k else 0.0
    np.testing.assert_allclose(np.asarray(same), outside, rtol=1e-5, atol=1e-6)


def _distill_recipe(base, **values):
    recipe = {
        "model": {"variant": "llama-nano", "init_from": str(base / "base")},
        "finetune": {"method": "full"},
        "distill": {"teacher": str(base / "base"), "temperature": 2.0, "ce_weight": 0.5},
        "data": {"source": {"kind": "files", "path": str(base / "corpus")}, "tokenizer": "bytes",
                 "seq_len": 32, "val_fraction": 0.1, "cache_dir": str(base / "tokens")},
        "optim": {"lr": 3e-3, "warmup_steps": 0},
        "train": {"batch_size": 4, "steps": 4, "log_every": 1, "eval_every": 2,
                  "checkpoint_every": 0, "objective": "distill"},
        "eval": {"sample_prompts": [], "batches": 1},
    }  # fmt: skip
    for path, value in values.items():
        section, key = path.split(".")
        recipe[section][key] = value
    return Recipe.from_dict(recipe)


@pytest.mark.slow  # three runs of the loop: about a minute
def test_distillation_from_its_own_starting_model_resumes_exactly(base, tmp_path):
    """The student starts from the teacher's weights and trains every one of them: the teacher
    is loaded apart (arrays of its own), so the step's donation leaves it intact; killed after 2
    steps and resumed, the run equals an uninterrupted one."""
    recipe = _distill_recipe(base)
    loop_mod.run(recipe, tmp_path / "a", final_eval=False, **QUIET)
    first = loop_mod.run(recipe, tmp_path / "b", stop_after=2, **QUIET)
    assert first.interrupted == "stop_after"
    loop_mod.run(recipe, tmp_path / "b", resume=True, final_eval=False, **QUIET)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a == b  # exact float equality
    steps = [r for r in a if "loss" in r]
    assert len(steps) == 4 and steps[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[3]["teacher_kl"] > 0 and [r["step"] for r in a if "val/loss" in r] == [2]


def test_distillation_refuses_a_teacher_with_another_vocabulary(base, tmp_path):
    other_tokenizer = _distill_recipe(
        base,
        **{
            "model.init_from": "",
            "finetune.method": "none",
            "data.tokenizer": "bpe",
            "data.bpe_vocab_size": 300,
        },  # fmt: skip
    )
    with pytest.raises(RecipeError, match="has another tokenizer .* set data.tokenizer to the"):
        loop_mod.run(other_tokenizer, tmp_path / "a", **QUIET)
    # The same tokenizer, a student sized 320 (257 rounded up to 64s): 257 ids to compare.
    wider = _distill_recipe(base, **{"model.init_from": "", "finetune.method": "none"})
    with pytest.raises(RecipeError, match="predicts 257 ids, the student 320"):
        loop_mod.run(wider, tmp_path / "b", **QUIET)
