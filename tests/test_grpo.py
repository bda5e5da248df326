"""GRPO: the loss against a direct NumPy computation, REINFORCE's gradient, rollouts."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.train.objectives import Grpo, group_advantages, grpo_loss, token_logps


def _numpy_grpo(logps, old, ref, rewards, mask, group, eps, eps_high, beta, norm, max_new):
    """The published formula, written out directly."""
    r = rewards.reshape(-1, group).astype(np.float64)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    adv = adv.reshape(-1, 1)
    logps, old, ref = (x.astype(np.float64) for x in (logps, old, ref))
    ratio = np.exp(logps - old)
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps_high) * adv)
    kl = np.exp(ref - logps) - (ref - logps) - 1
    per_token = -(surrogate - beta * kl)
    m = mask.astype(np.float64)
    if norm == "sequence":
        return np.mean((per_token * m).sum(1) / m.sum(1))
    if norm == "token":
        return (per_token * m).sum() / m.sum()
    return (per_token * m).sum() / (m.shape[0] * max_new)


@pytest.mark.parametrize("norm", ["sequence", "token", "constant"])
def test_grpo_loss_equals_numpy(norm):
    rng = np.random.default_rng(0)
    batch, targets, group = 8, 12, 4
    logps = rng.normal(-2, 0.5, (batch, targets)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, logps.shape)).astype(np.float32)  # ratios get clipped
    ref = (logps + rng.normal(0, 0.2, logps.shape)).astype(np.float32)
    rewards = rng.integers(0, 3, batch).astype(np.float32)
    mask = np.arange(targets)[None] < rng.integers(3, targets + 1, (batch, 1))
    loss, parts = grpo_loss(
        jnp.asarray(logps), jnp.asarray(old), jnp.asarray(ref),
        jnp.asarray(group_advantages(rewards, group)), jnp.asarray(mask),
        epsilon=0.2, epsilon_high=0.28, kl_coef=0.05, normalization=norm, max_new_tokens=16,
    )  # fmt: skip
    expected = _numpy_grpo(logps, old, ref, rewards, mask, group, 0.2, 0.28, 0.05, norm, 16)
    assert abs(float(loss) - expected) < 1e-6
    assert 0 < float(parts["clip_fraction"]) < 1


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.7, marks=pytest.mark.slow)])
def test_one_update_without_clipping_is_reinforce_with_a_group_baseline(temperature):
    """With rho = 1 (one inner update) and no KL, the GRPO gradient equals that of
    -mean_i A_i mean_t log pi(o_it): REINFORCE with the group mean as baseline, pi being the
    distribution the rollouts were sampled from, softmax(logits / temperature)."""
    model = eqllm.zoo.create(
        "llama-nano", d_model=32, n_layers=2, attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        vocab_size=64, key=jax.random.key(0),
    )  # fmt: skip
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, (6, 10)))
    mask = jnp.asarray(np.arange(9)[None] >= rng.integers(2, 6, (6, 1)))
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 1.0], np.float32)
    adv = jnp.asarray(group_advantages(rewards, 3))
    batch = {"tokens": tokens, "mask": mask, "advantages": adv, "rewards": jnp.asarray(rewards)}
    objective = Grpo(
        epsilon=0.2, epsilon_high=0.2, kl_coef=0.0, normalization="sequence",
        temperature=temperature,
    )  # fmt: skip
    (_, parts), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model, batch)

    def reinforce(model):
        logits = model(tokens[:, :-1]) / temperature
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
        per_seq = jnp.sum(jnp.where(mask, logp, 0.0), -1) / mask.sum(-1)
        return -jnp.mean(adv * per_seq)

    expected = eqx.filter_grad(reinforce)(model)
    direct = jax.nn.log_softmax(model(tokens[:, :-1]) / temperature)
    direct = jnp.take_along_axis(direct, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(token_logps(model, tokens, temperature), direct, atol=1e-6)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-7)
    assert float(parts["reward_mean"]) == pytest.approx(rewards.mean())
    assert float(parts["clip_fraction"]) == 0.0


def test_group_of_equal_rewards_has_no_advantage():
    scale = 1 / (np.std([0.0, 1.0], ddof=1) + 1e-4)
    expected = [0, 0, -0.5 * scale, 0.5 * scale]
    np.testing.assert_allclose(group_advantages(np.array([1, 1, 0, 1.0]), 2), expected, rtol=1e-6)


@pytest.mark.slow
def test_rollouts_are_deterministic_for_a_seed_and_train():
    from eqllm.data import Tokenizer
    from eqllm.recipe import OptimSpec
    from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
    from eqllm.train.objectives import rollout

    tok = Tokenizer.bytes()
    model = eqllm.zoo.create(
        "llama-nano", d_model=32, n_layers=2, attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        vocab_size=tok.vocab_size, key=jax.random.key(0),
    )  # fmt: skip
    examples = [{"prompt": "12>", "answer": "21"}, {"prompt": "345>", "answer": "543"}]
    prompts = [tok.encode(e["prompt"]) for e in examples]

    def reward(prompt, completion, example):
        return float(completion.startswith(example["answer"][:1]))

    def run(seed, step):
        return rollout(
            model, prompts, examples, decode=tok.decode, reward=reward, group_size=4,
            max_new_tokens=6, temperature=1.0, eos_id=tok.eot_id, width=12, seed=seed, step=step,
        )  # fmt: skip

    a, b, c = run(0, 3), run(0, 3), run(1, 3)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["tokens"], c["tokens"])
    assert a["tokens"].shape == (8, 12) and a["mask"].sum(1).min() >= 1
    # The completion's targets start right after the prompt.
    assert a["mask"][0, len(prompts[0]) - 1] and not a["mask"][0, len(prompts[0]) - 2]
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0), 3, model)
    step = TrainStep(optimizer, schedule(OptimSpec(), 3), objective=Grpo(max_new_tokens=6))
    state = init_opt_state(optimizer, model)
    for i in range(2):
        model, state, metrics = step(model, state, run(0, i))
        assert bool(metrics["finite"])
    assert step.n_traces == 1  # new rollouts, new weights: no recompilation


def test_built_in_rewards():
    from eqllm.train.rewards import reward_of

    exact = reward_of("exact_match", r"answer: (\d+)")
    assert exact("", "so answer: 12 or answer: 42", {"answer": 42}) == 1.0
    assert exact("", "answer: 41", {"answer": 42}) == 0.0
    assert reward_of("exact_match")("", " 42\nmore", {"answer": "42"}) == 1.0
    fmt = reward_of("format", r"^<think>.*</think>")
    assert fmt("", "<think>x</think> 1", {}) == 1.0 and fmt("", "1", {}) == 0.0
    brackets = reward_of("close_brackets")
    assert brackets("", "])\n        return", {"answer": "])"}) == 1.0
    assert brackets("", "])  \n", {"answer": "])"}) == 1.0  # trailing spaces do not count
    assert brackets("", "])", {"answer": "])"}) == pytest.approx(2 / 3)  # the line goes on
    assert brackets("", "]))\n", {"answer": "])"}) == pytest.approx(2 / 3)
    assert brackets("", ")]\n", {"answer": "])"}) == 0.0
    assert reward_of("json:dumps") is json.dumps


def test_close_brackets_rows_close_their_line_exactly(tmp_path):
    """Each generated prompt with its answer is a line of Python that parses, and without the
    answer's last bracket it does not; prompts are distinct, depths 1 to 3 in turn."""
    import ast

    from eqllm.train.rewards import write_close_brackets

    write_close_brackets(tmp_path / "rows.jsonl", n=60, seed=3)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len({r["prompt"] for r in rows}) == 60
    assert [len(r["answer"]) for r in rows[:6]] == [1, 2, 3, 1, 2, 3]
    for r in rows:
        ast.parse(r["prompt"] + r["answer"])
        with pytest.raises(SyntaxError):
            ast.parse(r["prompt"] + r["answer"][:-1])


@pytest.mark.slow  # a run with evaluations, then greedy generation per held-out prompt
def test_held_out_prompts_are_split_and_scored_greedily(tmp_path):
    """data.val_fraction of the prompts are held out (seeded, disjoint from training);
    val_reward is the mean reward of each one's greedy completion generated alone, and
    val_accuracy the share with the full reward."""
    from eqllm.data import Tokenizer
    from eqllm.data.prompts import prepare_prompts
    from eqllm.generation import generate
    from eqllm.recipe import Recipe
    from eqllm.runs import RunFolder
    from eqllm.train.objectives import Grpo

    tok = Tokenizer.bytes()
    rows = [{"prompt": f"{n}>", "answer": str(n)[::-1]} for n in range(10, 30)]
    file = tmp_path / "prompts.jsonl"
    file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = prepare_prompts(file, tok, val_fraction=0.25, seed=1)
    assert (len(data.prompts), len(data.val_prompts)) == (15, 5)
    held = {r["prompt"] for r in data.val_examples}
    assert held.isdisjoint(r["prompt"] for r in data.examples)
    assert held | {r["prompt"] for r in data.examples} == {r["prompt"] for r in rows}
    assert [tok.encode(r["prompt"]) for r in data.val_examples] == data.val_prompts
    assert held == {r["prompt"] for r in prepare_prompts(file, tok, val_fraction=0.25, seed=1)
                    .val_examples}  # fmt: skip
    assert prepare_prompts(file, tok).val_prompts == []

    model = eqllm.zoo.create(
        "llama-nano", d_model=32, n_layers=2, attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64}, vocab_size=tok.vocab_size, key=jax.random.key(2),
    )  # fmt: skip
    recipe = Recipe.from_dict(
        {
            "model": {"variant": "llama-nano", "init_from": str(tmp_path)},
            "finetune": {"method": "full"},
            "rl": {"data": str(file), "reward": "json:loads", "group_size": 2,
                   "max_new_tokens": 3},
            "data": {"seq_len": 16, "val_fraction": 0.25},
            "train": {"batch_size": 4, "steps": 1},
        }
    )  # fmt: skip

    def reward(prompt, completion, example):  # graded, and 1.0 for some completions
        return float(len(completion) >= 2) if prompt.startswith("1") else len(completion) / 6

    objective = Grpo.start(recipe, data, model, RunFolder(tmp_path), write=False)
    objective.run.reward = reward
    metrics = objective.evaluate(model)  # chunks of 4: the last one padded
    expected = []
    for prompt, example in zip(data.val_prompts, data.val_examples, strict=True):
        new = generate(model, prompt, max_new_tokens=3, key=jax.random.key(0), temperature=0.0,
                       stop_tokens=(tok.eot_id,))  # fmt: skip
        text = tok.decode([int(t) for t in new if t != tok.eot_id])
        expected.append(reward(example["prompt"], text, example))
    assert metrics["val_reward"] == pytest.approx(np.mean(expected), abs=1e-7)
    assert metrics["val_accuracy"] == pytest.approx(np.mean(np.asarray(expected) >= 1))
