"""GRPO ("grpo"; Shao et al., 2024): rollouts of rl.data's prompts scored by a reward,
group-relative advantages, a clipped surrogate and a k3 KL penalty.

For a group of G completions o_i of one prompt with rewards r_i, the advantage of every token of
o_i is `A_i = (r_i - mean(r)) / (std(r) + 1e-4)` (the group's sample standard deviation, as TRL
computes it). With rho_t = exp(log pi(o_t) - log pi_old(o_t)) (pi_old: the policy that sampled
the rollouts; rho = 1 with one inner update) and d_t = log pi_ref(o_t) - log pi(o_t):

    l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + kl_coef (exp(d_t) - d_t - 1)

(`exp(d) - d - 1` is Schulman's k3 estimator of KL(pi || pi_ref); epsilon_high > epsilon is
DAPO's asymmetric clip.) The loss averages l_t over the completion tokens:

- "sequence": each completion's mean, then the mean over completions (GRPO);
- "token": the sum over all completion tokens / their count (DAPO);
- "constant": the sum / (completions x max_new_tokens) (Dr. GRPO: no length bias).

All log-probabilities are the training forward's (`eqllm.train.objectives.token_logps`): the
sampling-time numbers differ slightly, so the ratios would not be exact. They are those of the
distribution the rollouts were sampled from, softmax(logits / temperature), as TRL computes
them: the policy, the old policy and the reference alike.

Rollouts (`rollout`): each prompt sampled `group_size` times with eqllm's compiled batched
generation (keys a function of (seed, step)), scored by the reward, laid out as the batch.
Every `rl.inner_updates` steps the batch is new rollouts from the model at that step (the batch
of the steps in between is the same, kept in the run folder, rollouts.npz, for an exact resume),
with the old policy's log-probabilities (more than one inner update) and the reference's
(kl_coef > 0: the adapters off under LoRA, else a copy of the starting model with arrays of its
own, which the step's donation of the trained model's buffers cannot touch). Rows are
min(data.seq_len, the model's context) + 1 tokens wide whatever the prompts, so the step
compiles once; every prompt plus rl.max_new_tokens must fit that, checked before the first
step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from eqllm import lora
from eqllm.data.prompts import PromptData, prepare_prompts
from eqllm.generation import generate_batch
from eqllm.recipe import Recipe, RecipeError, finetune_data_path
from eqllm.runs import RunFolder
from eqllm.train.balance import with_balance
from eqllm.train.objectives.base import (
    Objective,
    Run,
    base_tokenizer,
    one_process,
    own_copy,
    routed_logps,
    token_logps,
)
from eqllm.train.rewards import reward_of

NORMALIZATIONS = ("sequence", "token", "constant")
ROLLOUT_FILE = "rollouts.npz"  # the current batch of rollouts, for an exact mid-group resume
_token_logps = eqx.filter_jit(token_logps)


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per-completion advantages: rewards standardised within each group of `group_size`
    consecutive completions (sample std, + 1e-4 so a group of equal rewards gives zeros)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r)
    return ((r - r.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1).astype(np.float32)


def grpo_loss(
    logps: Float[Array, "batch targets"],
    old_logps: Float[Array, "batch targets"],
    ref_logps: Float[Array, "batch targets"] | None,
    advantages: Float[Array, " batch"],
    mask: Bool[Array, "batch targets"],
    *,
    epsilon: float,
    epsilon_high: float,
    kl_coef: float,
    normalization: str,
    max_new_tokens: int,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The GRPO loss of the module docstring and its metrics (kl: the masked mean of k3;
    clip_fraction: the share of completion tokens whose ratio was clipped)."""
    ratio = jnp.exp(logps - old_logps)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -jnp.minimum(ratio * a, clipped * a)
    if ref_logps is not None:
        d = ref_logps - logps
        k3 = jnp.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
    else:
        k3 = jnp.zeros_like(logps)
    m = mask.astype(jnp.float32)
    lengths = jnp.maximum(m.sum(-1), 1.0)
    if normalization == "sequence":
        loss = jnp.mean(jnp.sum(per_token * m, -1) / lengths)
    elif normalization == "token":
        loss = jnp.sum(per_token * m) / jnp.maximum(m.sum(), 1.0)
    elif normalization == "constant":
        loss = jnp.sum(per_token * m) / (m.shape[0] * max_new_tokens)
    else:
        raise ValueError(f"unknown normalization {normalization!r}; one of {NORMALIZATIONS}")
    tokens = jnp.maximum(m.sum(), 1.0)
    was_clipped = (ratio != clipped) & mask
    parts = {
        "kl": jax.lax.stop_gradient(jnp.sum(k3 * m) / tokens),
        "clip_fraction": jnp.sum(was_clipped) / tokens,
    }
    return loss, parts


Reward = Callable[[str, str, dict], float]


def rollout(
    model,
    prompts: Sequence[list[int]],
    examples: Sequence[dict],
    *,
    decode: Callable[[list[int]], str],
    reward: Reward,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    width: int,
    seed: int,
    step: int,
) -> dict[str, np.ndarray]:
    """The batch of `len(prompts) * group_size` completions: "tokens" [rows, width],
    "mask" [rows, width - 1] (the completion's targets, its end-of-sequence token included),
    "rewards" and "advantages" [rows] (standardised within each prompt's group)."""
    rows = [p for p in prompts for _ in range(group_size)]
    key = jax.random.fold_in(jax.random.key(seed), step)
    completions = generate_batch(
        model,
        rows,
        max_new_tokens=max_new_tokens,
        key=jax.random.split(key, len(rows)),
        temperature=temperature,
        stop_tokens=(eos_id,),
    )
    tokens = np.full((len(rows), width), eos_id, np.int64)
    mask = np.zeros((len(rows), width - 1), bool)
    rewards = np.zeros(len(rows), np.float32)
    for i, (prompt, new) in enumerate(zip(rows, completions, strict=True)):
        ids = list(prompt) + [int(t) for t in new]
        if len(ids) > width:
            raise ValueError(f"a rollout of {len(ids)} tokens does not fit the width {width}")
        tokens[i, : len(ids)] = ids
        mask[i, len(prompt) - 1 : len(ids) - 1] = True
        text = decode([int(t) for t in new if t != eos_id])
        example = examples[i // group_size]
        rewards[i] = float(reward(decode(list(prompt)), text, example))
    return {
        "tokens": tokens,
        "mask": mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_size),
    }


class GrpoRun(Run):
    """The run side: the prompts, the reward, the reference model (a copy of the starting
    model for full fine-tuning with kl_coef > 0, else None) and the current rollouts."""

    def __init__(self, recipe, data: PromptData, folder, *, write, reference, width: int):
        super().__init__(recipe, data, folder, write=write)
        r = recipe.rl
        self.reward = reward_of(r.reward, r.pattern, r.answer_field)
        self.reference = reference
        self.width = width  # tokens per row
        self.file = folder.file(ROLLOUT_FILE)
        self.group: int | None = None
        self.rollouts: dict | None = None


class Grpo(Objective):
    """The GRPO objective: batch {"tokens" [batch, window], "mask" [batch, window - 1] (the
    completion's targets), "advantages" [batch], "rewards" [batch], optional "old_logps" and
    "ref_logps" [batch, window - 1]} -> (loss, metrics).

    Without "old_logps" (one inner update) the ratio's denominator is the current policy under
    stop_gradient: rho = 1 in value, and its gradient is that of log pi.
    """

    name = "grpo"
    metrics = ("reward_mean", "kl", "completion_length", "clip_fraction")
    held_out = ("val_reward", "val_accuracy")
    console = ("reward_mean",)

    epsilon: float = eqx.field(default=0.2, static=True)
    epsilon_high: float = eqx.field(default=0.2, static=True)
    kl_coef: float = eqx.field(default=0.0, static=True)
    normalization: str = eqx.field(default="sequence", static=True)
    max_new_tokens: int = eqx.field(default=16, static=True)
    temperature: float = eqx.field(default=1.0, static=True)  # the rollouts' sampling temperature

    def loss(self, model, batch) -> tuple[Float[Array, ""], dict[str, Array]]:
        logps, balance = routed_logps(model, batch["tokens"], self.temperature)
        old = batch.get("old_logps", jax.lax.stop_gradient(logps))
        loss, parts = grpo_loss(
            logps,
            old,
            batch.get("ref_logps"),
            batch["advantages"],
            batch["mask"],
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            kl_coef=self.kl_coef,
            normalization=self.normalization,
            max_new_tokens=self.max_new_tokens,
        )
        parts["reward_mean"] = batch["rewards"].mean()
        parts["completion_length"] = batch["mask"].sum(-1).astype(jnp.float32).mean()
        return with_balance(model, loss, parts, balance)  # a mixture of experts' aux loss

    # The run ----------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, recipe: Recipe, *, progress: bool = True) -> PromptData:
        """rl.data's prompts (a string continued as it is, chat messages rendered with the base
        model's template), a seeded share held out."""
        tokenizer, template = base_tokenizer(recipe)
        d = recipe.data
        return prepare_prompts(
            finetune_data_path(recipe.rl.data),
            tokenizer,
            template=template,
            val_fraction=d.val_fraction,
            seed=d.split_seed,
        )

    @classmethod
    def start(
        cls, recipe: Recipe, data: PromptData, model, folder: RunFolder, *, write: bool
    ) -> Grpo:
        """Checks that every prompt's rollout fits the rows and the model's context; keeps a
        copy of the starting model as the KL reference for full fine-tuning."""
        r = recipe.rl
        context = model.config.max_seq_len
        seq_len = min(recipe.data.seq_len, context)
        room = min(seq_len + 1, context)  # a rollout is one row, generated within the context
        prompts = data.prompts + data.val_prompts
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        need = len(prompts[longest]) + r.max_new_tokens
        if need > room:
            example = (data.examples + data.val_examples)[longest]
            raise RecipeError(
                f"rl.data={r.data!r}: the prompt {str(example.get('prompt'))[:60]!r} has "
                f"{len(prompts[longest])} tokens, and with rl.max_new_tokens={r.max_new_tokens} "
                f"its rollouts need {need}, more than the {room} a row holds (data.seq_len="
                f"{recipe.data.seq_len}, the model's context {context}); shorten the prompts, "
                "lower rl.max_new_tokens or raise data.seq_len"
            )
        keep = r.kl_coef > 0 and not lora.adapters(model)
        reference = own_copy(model) if keep else None
        run = GrpoRun(recipe, data, folder, write=write, reference=reference, width=seq_len + 1)
        return cls(
            epsilon=r.epsilon,
            epsilon_high=r.epsilon_high or r.epsilon,
            kl_coef=r.kl_coef,
            normalization=r.normalization,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            run=run,
        )

    def setup_lines(self) -> list[str]:
        r = self.run.recipe.rl
        return [
            f"grpo: {r.group_size} completions per prompt of at most {r.max_new_tokens} tokens, "
            f"rows of {self.run.width} tokens"
        ]

    def batch(self, step: int, model) -> dict[str, np.ndarray]:
        """The rollouts of step `step`'s group (`rl.inner_updates` steps share one)."""
        one_process("rl.data")
        run = self.run
        r, t = run.recipe.rl, run.recipe.train
        group = step // r.inner_updates
        if run.group != group and run.file.is_file():
            with np.load(run.file) as cached:
                if int(cached["group"]) == group:
                    run.group = group
                    run.rollouts = {k: cached[k] for k in cached.files if k != "group"}
        if run.group == group:
            return dict(run.rollouts)
        data = run.data
        picks = data.pick(group, seed=t.seed, count=t.batch_size // r.group_size)
        batch = rollout(
            model,
            [data.prompts[i] for i in picks],
            [data.examples[i] for i in picks],
            decode=data.tokenizer.decode,
            reward=run.reward,
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            eos_id=data.tokenizer.eot_id,
            width=run.width,
            seed=t.seed,
            step=group,
        )
        tokens = jnp.asarray(batch["tokens"])
        if r.inner_updates > 1:  # the policy that sampled, for the ratios of later updates
            batch["old_logps"] = np.asarray(_token_logps(model, tokens, r.temperature))
        if r.kl_coef > 0:
            ref = lora.disabled(model) if run.reference is None else run.reference
            batch["ref_logps"] = np.asarray(_token_logps(ref, tokens, r.temperature))
        run.group, run.rollouts = group, batch
        if run.write and r.inner_updates > 1:
            np.savez(run.file, group=group, **batch)
        return dict(batch)

    def evaluate(self, model) -> dict[str, float]:
        """val_reward (the mean reward of greedy completions of the held-out prompts) and
        val_accuracy (the share of them scoring 1 or more: the full reward of the built-in
        ones); empty without held-out prompts."""
        run = self.run
        data, recipe = run.data, run.recipe
        prompts, n = data.val_prompts, len(data.val_prompts)
        if not n:
            return {}
        size = min(recipe.eval.batch_size or recipe.train.batch_size, n)
        eos = data.tokenizer.eot_id
        rewards = []
        for start in range(0, n, size):
            chunk = prompts[start : start + size]
            chunk = chunk + [chunk[-1]] * (size - len(chunk))  # one shape: one compilation
            out = generate_batch(
                model,
                chunk,
                max_new_tokens=recipe.rl.max_new_tokens,
                key=jax.random.key(0),  # unused: greedy
                temperature=0.0,
                stop_tokens=(eos,),
            )
            for i, new in enumerate(out[: min(size, n - start)]):
                text = data.tokenizer.decode([int(t) for t in new if t != eos])
                example = data.val_examples[start + i]
                prompt = data.tokenizer.decode(prompts[start + i])
                rewards.append(float(run.reward(prompt, text, example)))
        rewards = np.asarray(rewards)
        return {"val_reward": float(rewards.mean()), "val_accuracy": float((rewards >= 1).mean())}
