"""Post-training runs in the shared loop: the objective, the batches and the held-out metrics.

`start_post_training` returns None for pretraining and instruction tuning, else an object the
run set-up (`eqllm.train.setup`) hands its objective to the train step and its batches to the
loop: `batch(step, model)` (a pure function of the recipe, the seed, the step and, for RL, the
model at that step) and `evaluate(model)` (metrics on held-out data, at each evaluation).
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqllm import lora
from eqllm.data.instruct import prepare_instructions
from eqllm.data.preference import PreferenceData, prepare_preferences
from eqllm.data.prompts import PromptData, prepare_prompts
from eqllm.generation import generate_batch
from eqllm.model import CausalLM
from eqllm.recipe import Recipe, finetune_data_path, preference_data_source
from eqllm.train.grpo import Grpo
from eqllm.train.objectives import Preference, preference_eval, reference_logps, token_logps
from eqllm.train.rewards import reward_of
from eqllm.train.rollouts import rollout

REFERENCE_FILE = "reference_logps.npz"
ROLLOUT_FILE = "rollouts.npz"  # the current batch of rollouts, for an exact mid-group resume
_token_logps = eqx.filter_jit(token_logps)

# What metrics.jsonl logs of a post-training objective's step metrics.
OBJECTIVE_METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "reward_margin",
    "preference_accuracy",
    "reward_mean",
    "reward_std",
    "kl",
    "completion_length",
    "clip_fraction",
)


class PreferenceRun:
    """DPO, IPO or SimPO over `data`; `reference` holds the starting model's log-probabilities
    per pair ({"train", "val"}: [pairs, 2]) for full fine-tuning, None under LoRA (the step
    computes them with the adapters off) or for SimPO (no reference)."""

    def __init__(self, recipe: Recipe, data: PreferenceData, reference: dict | None):
        p = recipe.preference
        self.recipe = recipe
        self.data = data
        self.reference = reference
        self.objective = Preference(p.loss, p.beta, p.label_smoothing, p.gamma)

    def batch(self, step: int, model=None) -> dict[str, np.ndarray]:
        t = self.recipe.train
        batch = self.data.batch_at(step, seed=t.seed, batch_size=t.batch_size)
        return self._with_reference(batch, "train")

    def _with_reference(self, batch: dict, split: str) -> dict:
        index = batch.pop("index")
        if self.reference is not None:
            batch["ref"] = self.reference[split][index]
        return batch

    def evaluate(self, model: CausalLM) -> dict[str, float]:
        """val_preference_accuracy, val_reward_margin and val_preference_loss over every
        held-out pair (empty without any)."""
        n = len(self.data.val_rows)
        if not n:
            return {}
        size = self.recipe.eval.batch_size or self.recipe.train.batch_size
        sums: dict[str, float] = {}
        for start in range(0, n, size):
            index = np.arange(start, min(start + size, n))
            real = len(index)
            index = np.concatenate([index, np.full(size - real, index[-1])])  # one shape
            batch = self._with_reference(self.data.pairs(index, split="val"), "val")
            metrics = preference_eval(self.objective, model, jax.tree.map(jnp.asarray, batch))
            for k, v in metrics.items():  # per pair: the padding repeats are left out
                sums[k] = sums.get(k, 0.0) + float(np.asarray(v)[:real].sum())
        names = {"loss": "val_preference_loss", "preference_accuracy": "val_preference_accuracy"}
        names["reward_margin"] = "val_reward_margin"
        return {names[k]: v / n for k, v in sums.items() if k in names}


class GrpoRun:
    """GRPO: every `rl.inner_updates` steps, new rollouts from the model at that step (the
    batch of the steps in between is the same, kept in the run folder for resuming), with the
    old policy's log-probabilities (more than one inner update) and the reference's (kl_coef >
    0: the adapters off under LoRA, else `reference`, the starting model kept aside)."""

    def __init__(self, recipe: Recipe, data: PromptData, reference, out: Path, *, write: bool):
        r = recipe.rl
        self.recipe, self.data, self.reference = recipe, data, reference
        self.file = out / ROLLOUT_FILE
        self.write = write
        self.reward = reward_of(r.reward, r.pattern, r.answer_field)
        self.objective = Grpo(
            epsilon=r.epsilon,
            epsilon_high=r.epsilon_high or r.epsilon,
            kl_coef=r.kl_coef,
            normalization=r.normalization,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
        )
        self.eos = data.tokenizer.eot_id
        self._group: int | None = None
        self._batch: dict | None = None

    def batch(self, step: int, model: CausalLM) -> dict[str, np.ndarray]:
        r, t = self.recipe.rl, self.recipe.train
        group = step // r.inner_updates
        if self._group != group and self.file.is_file():
            with np.load(self.file) as cached:
                if int(cached["group"]) == group:
                    self._group = group
                    self._batch = {k: cached[k] for k in cached.files if k != "group"}
        if self._group == group:
            return dict(self._batch)
        picks = self.data.pick(group, seed=t.seed, count=t.batch_size // r.group_size)
        batch = rollout(
            model,
            [self.data.prompts[i] for i in picks],
            [self.data.examples[i] for i in picks],
            decode=self.data.tokenizer.decode,
            reward=self.reward,
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            eos_id=self.data.tokenizer.eot_id,
            width=self.recipe.data.seq_len + 1,
            seed=t.seed,
            step=group,
        )
        tokens = jnp.asarray(batch["tokens"])
        if r.inner_updates > 1:  # the policy that sampled, for the ratios of later updates
            batch["old_logps"] = np.asarray(_token_logps(model, tokens, r.temperature))
        if r.kl_coef > 0:
            ref = lora.disabled(model) if self.reference is None else self.reference
            batch["ref_logps"] = np.asarray(_token_logps(ref, tokens, r.temperature))
        self._group, self._batch = group, batch
        if self.write and r.inner_updates > 1:
            np.savez(self.file, group=group, **batch)
        return dict(batch)

    def evaluate(self, model: CausalLM) -> dict[str, float]:
        """val_reward (the mean reward of greedy completions of the held-out prompts) and
        val_accuracy (the share of them scoring 1 or more: the full reward of the built-in
        ones); empty without held-out prompts."""
        prompts, n = self.data.val_prompts, len(self.data.val_prompts)
        if not n:
            return {}
        size = min(self.recipe.eval.batch_size or self.recipe.train.batch_size, n)
        rewards = []
        for start in range(0, n, size):
            chunk = prompts[start : start + size]
            chunk = chunk + [chunk[-1]] * (size - len(chunk))  # one shape: one compilation
            out = generate_batch(
                model,
                chunk,
                max_new_tokens=self.recipe.rl.max_new_tokens,
                key=jax.random.key(0),  # unused: greedy
                temperature=0.0,
                stop_tokens=(self.data.tokenizer.eot_id,),
            )
            for i, new in enumerate(out[: min(size, n - start)]):
                text = self.data.tokenizer.decode([int(t) for t in new if t != self.eos])
                example = self.data.val_examples[start + i]
                prompt = self.data.tokenizer.decode(prompts[start + i])
                rewards.append(float(self.reward(prompt, text, example)))
        rewards = np.asarray(rewards)
        return {"val_reward": float(rewards.mean()), "val_accuracy": float((rewards >= 1).mean())}


def prepare_rows(recipe: Recipe, tokenizer, template):
    """The examples of finetune.data, preference.data or rl.data, tokenized."""
    d = recipe.data
    if recipe.rl.data:
        path = finetune_data_path(recipe.rl.data)
        held = dict(val_fraction=d.val_fraction, seed=d.split_seed)
        return prepare_prompts(path, tokenizer, template=template, **held)
    common = dict(seq_len=d.seq_len, template=template, val_fraction=d.val_fraction)
    p = recipe.preference
    if p.data:
        source = preference_data_source(p.data)
        fields = (p.prompt_field, p.chosen_field, p.rejected_field)
        return prepare_preferences(
            source, tokenizer, **common, seed=d.split_seed, split=p.split, fields=fields
        )
    path = finetune_data_path(recipe.finetune.data)
    return prepare_instructions(
        path, tokenizer, **common, seed=d.split_seed, pack=recipe.finetune.pack
    )


def start_post_training(
    recipe: Recipe, data, model: CausalLM, out: Path, *, write: bool
) -> PreferenceRun | GrpoRun | None:
    """The run's post-training objective and batches (None when it has none). `model` is the
    starting model (before a checkpoint is restored): full fine-tuning's preference reference
    is computed from it once and cached in `out/reference_logps.npz`."""
    if isinstance(data, PromptData):
        keep = recipe.rl.kl_coef > 0 and not lora.adapters(model)
        return GrpoRun(recipe, data, model if keep else None, out, write=write)
    if not isinstance(data, PreferenceData):
        return None
    reference = None
    if recipe.preference.loss != "simpo" and not lora.adapters(model):
        reference = _reference(data, model, out / REFERENCE_FILE, recipe, write=write)
    return PreferenceRun(recipe, data, reference)


def _reference(data: PreferenceData, model, file: Path, recipe: Recipe, *, write: bool) -> dict:
    """The starting model's summed response log-probabilities of every pair, cached."""
    if file.is_file():
        with np.load(file) as cached:
            return {"train": cached["train"], "val": cached["val"]}
    size = recipe.eval.batch_size or recipe.train.batch_size
    result = {}
    for split, n in (("train", len(data.rows)), ("val", len(data.val_rows))):
        out = np.zeros((n, 2), np.float32)
        for start in range(0, n, size):
            index = np.arange(start, min(start + size, n))
            index = np.concatenate([index, np.full(size - len(index), index[-1])])  # one shape
            pairs = data.pairs(index, split=split)
            tokens = jnp.asarray(pairs["tokens"]).reshape(2 * size, -1)
            mask = jnp.asarray(pairs["mask"]).reshape(2 * size, -1)
            logps = np.asarray(reference_logps(model, tokens, mask)).reshape(size, 2)
            out[index] = logps
        result[split] = out
    if write:
        np.savez(file, **result)
    return result
