"""Preference optimisation ("dpo", "ipo", "simpo") on pairs of responses (preference.data).

The reference is the frozen starting model: under LoRA the same weights with the adapters off,
computed in the same step (no second copy); with full fine-tuning its log-probabilities of every
pair, computed once before the first step and cached in the run folder (reference_logps.npz,
reused on resume), so no frozen copy shares arrays with the model the step trains.

With pi and ref the summed log-probabilities of a response's tokens, |y| its length, and
delta = [pi(y_w) - ref(y_w)] - [pi(y_l) - ref(y_l)]:

- dpo (Rafailov et al., 2023; label smoothing eps is conservative DPO):
  `-(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)`
- ipo (Azar et al., 2023, length-normalised as TRL computes it):
  `(delta_w / |y_w| - delta_l / |y_l| - 1 / (2 beta))^2` with delta_* the log-ratios
- simpo (Meng et al., 2024; no reference):
  `-(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)`,
  `m = pi(y_w) / |y_w| - pi(y_l) / |y_l| - gamma / beta`

On a mixture of experts the loss adds moe.aux_loss_coef times the policy forward's
load-balancing loss, as pretraining does (`eqllm.train.balance`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from eqllm import lora
from eqllm.data.preference import PreferenceData, prepare_preferences
from eqllm.recipe import PREFERENCE_LOSSES, Recipe, preference_data_source
from eqllm.runs import RunFolder
from eqllm.train.balance import with_balance
from eqllm.train.objectives.base import (
    Objective,
    Run,
    base_tokenizer,
    one_process,
    routed_logps,
    sequence_logps,
)

REFERENCE_FILE = "reference_logps.npz"

reference_logps = eqx.filter_jit(sequence_logps)  # before training, for full fine-tuning


def preference_loss(
    kind: str,
    policy: Float[Array, "batch 2"],
    reference: Float[Array, "batch 2"] | None,
    lengths: Float[Array, "batch 2"],
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The mean loss over pairs and its metrics, from summed response log-probabilities.

    Arguments:
        kind: "dpo", "ipo" or "simpo" (see the module docstring).
        policy: [pairs, 2] log-probabilities of (chosen, rejected) under the model trained.
        reference: the same under the reference (None for simpo).
        lengths: [pairs, 2] response lengths in tokens.
        beta, label_smoothing, gamma: the losses' settings.

    Metrics: rewards_chosen / rewards_rejected (the mean implicit rewards: beta times the
    log-ratio, or for simpo beta times the mean log-probability), reward_margin (their mean
    difference), preference_accuracy (the share of pairs whose chosen reward is higher).
    """
    lengths = jnp.maximum(lengths, 1.0)
    if kind == "simpo":
        rewards = beta * policy / lengths
        margin = policy[:, 0] / lengths[:, 0] - policy[:, 1] / lengths[:, 1] - gamma / beta
        losses = _smoothed(beta * margin, label_smoothing)
    else:
        ratios = policy - reference
        rewards = beta * ratios
        if kind == "dpo":
            losses = _smoothed(beta * (ratios[:, 0] - ratios[:, 1]), label_smoothing)
        elif kind == "ipo":
            avg = ratios / lengths
            losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss {kind!r}; one of {PREFERENCE_LOSSES}")
    rewards = jax.lax.stop_gradient(rewards)
    parts = {
        "rewards_chosen": rewards[:, 0].mean(),
        "rewards_rejected": rewards[:, 1].mean(),
        "reward_margin": (rewards[:, 0] - rewards[:, 1]).mean(),
        "preference_accuracy": (rewards[:, 0] > rewards[:, 1]).mean(),
    }
    return losses.mean(), parts


def _smoothed(logits: Float[Array, " batch"], eps: float) -> Float[Array, " batch"]:
    return -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


class PreferenceRun(Run):
    """The run side: the pairs, and the starting model's log-probabilities of every pair
    ({"train", "val"}: [pairs, 2]) for full fine-tuning (None under LoRA or for SimPO)."""

    def __init__(self, recipe, data: PreferenceData, folder, *, write, reference: dict | None):
        super().__init__(recipe, data, folder, write=write)
        self.reference = reference


class Preference(Objective):
    """DPO, IPO or SimPO (`kind`) on a batch {"tokens" [pairs, 2, window], "mask" [pairs, 2,
    window - 1] (the responses' targets), optional "ref" [pairs, 2]}.

    Without "ref" in the batch the reference is `model` with its LoRA adapters off (the same
    arrays: no second copy), under stop_gradient; simpo has none.
    """

    metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")
    held_out = ("val_preference_accuracy", "val_reward_margin", "val_preference_loss")
    console = ("preference_accuracy",)
    chat = True

    kind: str = eqx.field(default="dpo", static=True)
    beta: float = eqx.field(default=0.1, static=True)
    label_smoothing: float = eqx.field(default=0.0, static=True)
    gamma: float = eqx.field(default=0.0, static=True)

    @property
    def name(self) -> str:
        return self.kind

    def scores(self, model, batch) -> tuple[Array, Array | None, Array, dict]:
        """(policy, reference, lengths), each [pairs, 2], and the policy forward's balance
        terms ({} for a dense model)."""
        tokens, mask = batch["tokens"], batch["mask"]
        pairs = tokens.shape[0]
        flat_tokens = tokens.reshape(2 * pairs, -1)  # chosen and rejected of a pair side by side
        flat_mask = mask.reshape(2 * pairs, -1)
        logps, balance = routed_logps(model, flat_tokens)
        policy = jnp.sum(jnp.where(flat_mask, logps, 0.0), axis=-1).reshape(pairs, 2)
        lengths = mask.sum(-1).astype(jnp.float32)
        if self.kind == "simpo":
            return policy, None, lengths, balance
        if "ref" in batch:
            return policy, batch["ref"], lengths, balance
        if not lora.adapters(model):
            raise ValueError("a preference batch without 'ref' needs a model with LoRA adapters")
        base = lora.disabled(model)
        ref = jax.lax.stop_gradient(sequence_logps(base, flat_tokens, flat_mask).reshape(pairs, 2))
        return policy, ref, lengths, balance

    def loss(self, model, batch) -> tuple[Float[Array, ""], dict[str, Array]]:
        """The loss (plus a mixture of experts' load-balancing term) and its metrics."""
        policy, ref, lengths, balance = self.scores(model, batch)
        loss, parts = preference_loss(
            self.kind,
            policy,
            ref,
            lengths,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            gamma=self.gamma,
        )
        return with_balance(model, loss, parts, balance)

    # The run ----------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, recipe: Recipe, *, progress: bool = True) -> PreferenceData:
        """preference.data's pairs, each side rendered with the base model's chat template."""
        tokenizer, template = base_tokenizer(recipe)
        d, p = recipe.data, recipe.preference
        return prepare_preferences(
            preference_data_source(p.data),
            tokenizer,
            seq_len=d.seq_len,
            template=template,
            val_fraction=d.val_fraction,
            seed=d.split_seed,
            split=p.split,
            fields=(p.prompt_field, p.chosen_field, p.rejected_field),
        )

    @classmethod
    def start(
        cls, recipe: Recipe, data: PreferenceData, model, folder: RunFolder, *, write: bool
    ) -> Preference:
        """With full fine-tuning the reference is computed here, from the starting `model`
        (before any checkpoint is restored), once: cached in the run folder."""
        p = recipe.preference
        reference = None
        if p.loss != "simpo" and not lora.adapters(model):
            reference = _reference(data, model, folder.file(REFERENCE_FILE), recipe, write=write)
        run = PreferenceRun(recipe, data, folder, write=write, reference=reference)
        return cls(p.loss, p.beta, p.label_smoothing, p.gamma, run=run)

    def batch(self, step: int, model=None) -> dict[str, np.ndarray]:
        one_process("preference.data")
        t = self.run.recipe.train
        batch = self.run.data.batch_at(step, seed=t.seed, batch_size=t.batch_size)
        return self._with_reference(batch, "train")

    def _with_reference(self, batch: dict, split: str) -> dict:
        index = batch.pop("index")
        if self.run.reference is not None:
            batch["ref"] = self.run.reference[split][index]
        return batch

    def evaluate(self, model) -> dict[str, float]:
        """val_preference_accuracy, val_reward_margin and val_preference_loss over every
        held-out pair (empty without any)."""
        recipe, data = self.run.recipe, self.run.data
        n = len(data.val_rows)
        if not n:
            return {}
        size = recipe.eval.batch_size or recipe.train.batch_size
        sums: dict[str, float] = {}
        for start in range(0, n, size):
            index = np.arange(start, min(start + size, n))
            real = len(index)
            index = np.concatenate([index, np.full(size - real, index[-1])])  # one shape
            batch = self._with_reference(data.pairs(index, split="val"), "val")
            metrics = preference_eval(self, model, jax.tree.map(jnp.asarray, batch))
            for k, v in metrics.items():  # per pair: the padding repeats are left out
                sums[k] = sums.get(k, 0.0) + float(np.asarray(v)[:real].sum())
        names = {"loss": "val_preference_loss", "preference_accuracy": "val_preference_accuracy"}
        names["reward_margin"] = "val_reward_margin"
        return {names[k]: v / n for k, v in sums.items() if k in names}


@eqx.filter_jit
def preference_eval(objective: Preference, model, batch) -> dict[str, Array]:
    """Per pair ([pairs] each), without a gradient: the objective's loss and metrics."""
    policy, ref, lengths, _ = objective.scores(model, batch)
    ref = jnp.zeros_like(policy) if ref is None else ref  # simpo reads no reference

    def one(p, r, n):
        loss, parts = preference_loss(
            objective.kind,
            p[None],
            r[None],
            n[None],
            beta=objective.beta,
            label_smoothing=objective.label_smoothing,
            gamma=objective.gamma,
        )
        return {"loss": loss, **parts}

    return jax.vmap(one)(policy, ref, lengths)


def _reference(data: PreferenceData, model, file, recipe: Recipe, *, write: bool) -> dict:
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
