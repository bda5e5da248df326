"""Preference and GRPO runs through `eqllm run`'s loop: resumed mid-run, they continue exactly
as uninterrupted ones; the full fine-tuning reference is cached in the run folder."""

import json
import sys
import types

import jax
import numpy as np
import pytest

import eqllm
from eqllm.data import Tokenizer
from eqllm.recipe import Recipe, RecipeError
from eqllm.train import loop

PAIRS = [
    {"prompt": f"Return {w}.", "chosen": f"return {w}\n", "rejected": f"retrun {w}\n"}
    for w in ("a", "b", "cc", "dd", "e", "ff", "g", "hh")
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from eqllm.hub.folders import save_tokenizer

    root = tmp_path_factory.mktemp("post")
    model = eqllm.zoo.create(
        "llama-nano", vocab_size=257, d_model=32, n_layers=2,
        attention={"n_heads": 2, "n_kv_heads": 1}, mlp={"d_ff": 64},
        max_seq_len=128, key=jax.random.key(0),
    )  # fmt: skip
    eqllm.hub.save_pretrained(model, root / "base", tokenizer=Tokenizer.bytes())
    save_tokenizer(Tokenizer.bytes(), root / "base")
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    rows = [{"prompt": f"{n}>", "answer": str(n)[::-1]} for n in range(10, 30)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def _recipe(base, kind, method="lora", steps=6):
    values = {
        "model": {"variant": "llama-nano", "init_from": str(base / "base")},
        "finetune": {"method": method, "rank": 2, "alpha": 4.0, "targets": ["q_proj", "v_proj"]},
        "data": {"seq_len": 40, "val_fraction": 0.25},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "train": {"batch_size": 4, "steps": steps, "eval_every": 3, "checkpoint_every": 0,
                  "log_every": 1},
        "eval": {"sample_prompts": [], "batches": 1},
    }  # fmt: skip
    if kind == "grpo":
        values["rl"] = {
            "data": str(base / "prompts.jsonl"), "reward": "toy_rewards:first_byte",
            "group_size": 2, "max_new_tokens": 4, "kl_coef": 0.1, "inner_updates": 2,
            "epsilon": 0.2,
        }  # fmt: skip
    else:
        values["preference"] = {"data": str(base / "pairs.jsonl"), "loss": kind, "beta": 0.5}
    return Recipe.from_dict(values)


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drop = ("tokens_per_s", "step_s", "mfu", "compile_s", "loader_tokens_per_s", "eval_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in rows if "compile_s" not in r]


@pytest.mark.slow  # three runs of the loop twice each: about a minute each on an idle CPU
@pytest.mark.parametrize(("kind", "method"), [("dpo", "lora"), ("ipo", "full"), ("grpo", "lora")])
def test_resumed_run_equals_uninterrupted(base, tmp_path, monkeypatch, kind, method):
    # A reward named as module:function, graded so that every group has advantages.
    rewards = types.ModuleType("toy_rewards")
    rewards.first_byte = lambda prompt, completion, example: float(len(completion.encode()))
    monkeypatch.setitem(sys.modules, "toy_rewards", rewards)
    recipe = _recipe(base, kind, method)
    quiet = dict(progress=False, echo=lambda *a: None)
    loop.run(recipe, tmp_path / "a", final_eval=False, **quiet)
    first = loop.run(recipe, tmp_path / "b", stop_after=3, **quiet)
    assert first.interrupted == "stop_after"
    loop.run(recipe, tmp_path / "b", resume=True, final_eval=False, **quiet)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a == b and len([r for r in a if "loss" in r]) == 6  # exact float equality
    steps = [r for r in a if "loss" in r]
    held_out = [r["step"] for r in a if "val_reward" in r or "val_preference_accuracy" in r]
    assert held_out == [0, 3]  # the starting model, then each evaluation (not final_eval)
    if kind == "dpo":
        assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference
        assert all(k in steps[0] for k in ("rewards_chosen", "reward_margin"))
        assert "preference_accuracy" in steps[0]
    if method == "full" and kind != "grpo":
        assert (tmp_path / "a" / "reference_logps.npz").is_file()
    if kind == "grpo":
        assert all(k in steps[0] for k in ("reward_mean", "kl", "completion_length"))
        assert steps[0]["kl"] == 0.0 and steps[2]["kl"] > 0  # the adapters move away
        assert all("val_accuracy" in r for r in a if "val_reward" in r)


def test_preference_recipe_needs_a_base_and_one_objective(base):
    with pytest.raises(RecipeError, match="preference.data=.* needs finetune.method"):
        _recipe(base, "dpo", method="none")
    values = _recipe(base, "dpo").to_dict()
    values["finetune"]["data"] = str(base / "pairs.jsonl")
    with pytest.raises(RecipeError, match="a run trains one objective"):
        Recipe.from_dict(values)
