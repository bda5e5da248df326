"""Language modelling ("lm"): next-token cross entropy on token windows of the recipe's corpus.

The batch of step s is `eqllm.data.batch_at(train, step=s, seed=seed)` (or a mixture's rows,
`eqllm.data.MixtureData.batch_at`): a pure function of the seed and the step. With
data.document_mask, attention stays inside each document of a window (segments open at every
end-of-text token); data.reset_positions restarts positions at each document. A mixture of
experts adds moe.aux_loss_coef times its load-balancing loss (`eqllm.train.balance`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm.data import DataError, MixtureData, TokenData, batch_at
from eqllm.data.segments import document_positions, document_segments
from eqllm.eval.loss import masked_mean
from eqllm.recipe import Recipe, RecipeError, prepare_corpus
from eqllm.runs import RunFolder
from eqllm.train.balance import forward, with_balance
from eqllm.train.objectives.base import Objective, Run


class LanguageModel(Objective):
    """Mean next-token cross entropy over a batch {"tokens" [batch, window], optional "mask"
    [batch, window - 1] (the targets scored; all without), optional "segment_ids" [batch,
    window] (packed documents: attention kept inside each)}.

    document_token: segments open at this end-of-text id when the batch brings none (None:
        off). reset_positions: positions restart at 0 in each segment. z_loss: the z-loss
        coefficient (optim.z_loss; `next_token_loss`).
    """

    name = "lm"

    document_token: int | None = eqx.field(default=None, static=True)
    reset_positions: bool = eqx.field(default=False, static=True)
    z_loss: float = eqx.field(default=0.0, static=True)

    def loss(self, model, batch: dict[str, Array]) -> tuple[Float[Array, ""], dict[str, Array]]:
        """`next_token_loss` of the batch."""
        _, positions, segment_ids = self.inputs(batch)
        return next_token_loss(
            model, batch["tokens"], batch.get("mask"), positions, segment_ids, self.z_loss
        )

    def inputs(self, batch: dict[str, Array]) -> tuple[Array, Array | None, Array | None]:
        """(input tokens, positions, segment ids) of the forward: segments from the batch or
        from `document_token`, positions restarting in each with `reset_positions` (None:
        in order)."""
        tokens = batch["tokens"]
        segment_ids = batch.get("segment_ids")
        if segment_ids is None and self.document_token is not None:
            segment_ids = document_segments(tokens, self.document_token)
        positions = None
        if segment_ids is not None:
            segment_ids = segment_ids[:, :-1]  # those of the inputs
            positions = document_positions(segment_ids) if self.reset_positions else None
        return tokens[:, :-1], positions, segment_ids

    def check(self, model, batch: dict) -> None:
        super().check(model, batch)
        tokens, mask, segments = batch["tokens"], batch.get("mask"), batch.get("segment_ids")
        if mask is not None and mask.shape != (tokens.shape[0], tokens.shape[1] - 1):
            raise DataError(
                f"loss mask of shape {mask.shape} does not fit the batch {tokens.shape}: it must "
                "be (batch, window - 1), one entry per target"
            )
        if segments is not None and segments.shape != tokens.shape:
            raise DataError(
                f"segment ids of shape {segments.shape} do not fit the batch {tokens.shape}: "
                "give one id per token"
            )

    @classmethod
    def prepare(cls, recipe: Recipe, *, progress: bool = True) -> TokenData | MixtureData:
        """data.source's tokens (or data.sources' mixture), with more than one window."""
        data = prepare_corpus(recipe, progress=progress)
        check_windows(data, recipe)
        return data

    @classmethod
    def start(cls, recipe: Recipe, data, model, folder: RunFolder, *, write: bool) -> LanguageModel:
        eot = data.tokenizer.eot_id if recipe.data.document_mask else None
        return cls(
            document_token=eot,
            reset_positions=recipe.data.reset_positions,
            z_loss=recipe.optim.z_loss,
            run=Run(recipe, data, folder, write=write),
        )

    def batch(self, step: int, model=None) -> dict[str, np.ndarray]:
        return {"tokens": token_batch(self.run.data, self.run.recipe, step)}


def next_token_loss(
    model,
    tokens: Int[Array, "batch window"],
    mask: Bool[Array, "batch window-1"] | None = None,
    positions: Int[Array, "batch window-1"] | None = None,
    segment_ids: Int[Array, "batch window-1"] | None = None,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The mean next-token cross entropy over the (masked-in) targets `tokens[:, 1:]`, plus a
    mixture of experts' balance term; its parts: "ce" (the cross entropy, which the step reports
    as its loss) and, with experts, "aux_loss" and "expert_load". `positions` and
    `segment_ids` (of the inputs `tokens[:, :-1]`) go to the model as they are.

    `z_loss` > 0 adds z_loss * mean(logsumexp(logits)^2) over the same targets (PaLM's z-loss,
    which keeps the softmax normaliser near 1), the mean reported as the part "z_loss" (before
    its coefficient, as a mixture's "aux_loss" is); the logsumexp is the cross entropy's own."""
    logits, balance = forward(model, tokens[:, :-1], positions, segment_ids)  # fp32
    if not z_loss:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        ce = masked_mean(nll, mask)
        return with_balance(model, ce, {"ce": ce}, balance)
    nll, lse = cross_entropy_and_logsumexp(logits, tokens[:, 1:])
    ce = masked_mean(nll, mask)
    z = masked_mean(jnp.square(lse), mask)
    return with_balance(model, ce + z_loss * z, {"ce": ce, "z_loss": z}, balance)


def cross_entropy_and_logsumexp(
    logits: Float[Array, "*targets vocab"], labels: Int[Array, "*targets"]
) -> tuple[Float[Array, "*targets"], Float[Array, "*targets"]]:
    """(-log softmax(logits)[label], logsumexp(logits)) per target, from one logsumexp (as
    optax's softmax_cross_entropy_with_integer_labels computes it: the max shifted out)."""
    shift = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    shifted = logits - shift
    label_logits = jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0]
    log_normalizer = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    return log_normalizer - label_logits, log_normalizer + shift[..., 0]


def check_windows(data: TokenData | MixtureData, recipe: Recipe) -> None:
    """A training split longer than one window of data.seq_len + 1 tokens."""
    seq_len = recipe.data.seq_len
    if data.train.shape[0] <= seq_len:
        raise RecipeError(
            f"data.seq_len={seq_len} needs more than {seq_len} training tokens; the corpus has "
            f"{data.train.shape[0]} (use more data or a shorter seq_len)"
        )


def token_batch(data: TokenData | MixtureData, recipe: Recipe, step: int) -> np.ndarray:
    """This process's rows of step `step`'s global batch of token windows."""
    args = dict(
        step=step,
        seed=recipe.train.seed,
        batch_size=recipe.train.batch_size,
        seq_len=recipe.data.seq_len,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if isinstance(data, MixtureData):
        return data.batch_at(**args)
    return batch_at(data.train, **args)
