"""Knowledge distillation ("distill"; Hinton et al., 2015): the student learns the teacher's
next-token distribution on the recipe's corpus.

The teacher (distill.teacher) is any model eqllm loads (`eqllm.loading.load`: a run folder, an
eqllm or Hugging Face folder, a hub repo id, a zoo name) sharing the student's tokenizer: a
different vocabulary is refused before the first step. It runs frozen inside the train step,
on the same mesh, as an argument the step never donates (its arrays are its own).

With temperature T, p_t = softmax(teacher logits / T), p_s = softmax(student logits / T) and
w = distill.ce_weight, the loss per target is

    (1 - w) * T^2 * KL(p_t || p_s) + w * CE(student, data)

(forward KL, the teacher's distribution as the target; T^2 keeps the gradient's scale as T
changes). With distill.top_k = k the KL is taken over the teacher's k most likely tokens only,
the teacher renormalised over them and the student's log-probabilities those of the whole
vocabulary (the form of top-k logits stored from a teacher): the target is the teacher
truncated to its top k, so a student equal to its teacher still pays -log of the mass it puts
on the other tokens, and no [batch, seq, vocab] teacher distribution is kept. Both terms are
means over the targets, like the language model's loss; its batches are the language model's.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from eqllm.data import TokenData
from eqllm.eval.loss import masked_mean
from eqllm.loading import load
from eqllm.recipe import Recipe, RecipeError
from eqllm.runs import RunFolder
from eqllm.sharding import shard_model
from eqllm.train.balance import forward, with_balance
from eqllm.train.objectives.base import Run
from eqllm.train.objectives.lm import LanguageModel


def distill_kl(
    student: Float[Array, "*rows vocab"],
    teacher: Float[Array, "*rows vocab"],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
) -> Float[Array, "*rows"]:
    """KL(p_t || p_s) per row of logits at `temperature`; over the teacher's `top_k` most
    likely tokens (teacher renormalised over them) when top_k > 0."""
    log_s = jax.nn.log_softmax(student.astype(jnp.float32) / temperature)
    teacher = teacher.astype(jnp.float32) / temperature
    if top_k:
        teacher, index = jax.lax.top_k(teacher, top_k)
        log_s = jnp.take_along_axis(log_s, index, axis=-1)
    log_t = jax.nn.log_softmax(teacher)
    return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)


class Distill(LanguageModel):
    """The distillation loss on the language model's batch {"tokens", optional "mask" and
    "segment_ids"}; `teacher` is frozen (no gradient, never donated)."""

    name = "distill"
    metrics = ("teacher_kl", "data_ce")
    console = ("teacher_kl",)

    teacher: Any = None
    temperature: float = eqx.field(default=1.0, static=True)
    ce_weight: float = eqx.field(default=0.0, static=True)
    top_k: int = eqx.field(default=0, static=True)

    def loss(self, model, batch: dict[str, Array]) -> tuple[Float[Array, ""], dict[str, Array]]:
        """The mixed loss, its metrics "teacher_kl" (T^2 KL) and "data_ce", plus a mixture of
        experts' balance term of the student's forward."""
        inputs = self.inputs(batch)
        logits, balance = forward(model, *inputs)
        teacher_logits, _ = forward(self.teacher, *inputs)
        teacher_logits = jax.lax.stop_gradient(teacher_logits)
        mask = batch.get("mask")
        kl = distill_kl(logits, teacher_logits, temperature=self.temperature, top_k=self.top_k)
        kd = self.temperature**2 * masked_mean(kl, mask)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        ce = masked_mean(nll, mask)
        loss = (1 - self.ce_weight) * kd + self.ce_weight * ce
        return with_balance(model, loss, {"teacher_kl": kd, "data_ce": ce}, balance)

    @classmethod
    def start(cls, recipe: Recipe, data: TokenData, model, folder: RunFolder, *, write: bool):
        """Loads the teacher and checks that it shares the student's tokenizer."""
        d = recipe.distill
        teacher, tokenizer = load(d.teacher)
        vocab = data.tokenizer.hf.get_vocab(with_added_tokens=True)
        if tokenizer is not None and tokenizer.hf.get_vocab(with_added_tokens=True) != vocab:
            raise RecipeError(
                f"distill.teacher={d.teacher!r} has another tokenizer ({tokenizer.vocab_size} "
                f"ids) than the student's data.tokenizer={recipe.data.tokenizer!r} "
                f"({data.tokenizer.vocab_size} ids): the KL compares the two next-token "
                "distributions id by id; set data.tokenizer to the teacher's folder"
            )
        if teacher.config.vocab_size != model.config.vocab_size:
            raise RecipeError(
                f"distill.teacher={d.teacher!r} predicts {teacher.config.vocab_size} ids, the "
                f"student {model.config.vocab_size}: give the student the teacher's vocab_size "
                f"(model.overrides.vocab_size={teacher.config.vocab_size})"
            )
        if d.top_k > model.config.vocab_size:
            raise RecipeError(
                f"distill.top_k={d.top_k} is more than the vocabulary of "
                f"{model.config.vocab_size} ids; use at most that, or 0 for all"
            )
        teacher = teacher.with_config(compute_dtype=recipe.train.precision)
        eot = data.tokenizer.eot_id if recipe.data.document_mask else None
        return cls(
            document_token=eot,
            reset_positions=recipe.data.reset_positions,
            teacher=teacher,
            temperature=d.temperature,
            ce_weight=d.ce_weight,
            top_k=d.top_k,
            run=Run(recipe, data, folder, write=write),
        )

    def placed(self, mesh) -> Distill:
        """The teacher split over `mesh` as the student is (the same rules)."""
        return eqx.tree_at(lambda o: o.teacher, self, shard_model(self.teacher, mesh))

    def setup_lines(self) -> list[str]:
        d = self.run.recipe.distill
        top = f", KL over the teacher's top {d.top_k}" if d.top_k else ""
        return [
            f"distill: teacher {d.teacher} ({self.teacher.config.family}, frozen), temperature "
            f"{d.temperature:g}, cross-entropy weight {d.ce_weight:g}{top}"
        ]
