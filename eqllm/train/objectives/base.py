"""What every objective is: one object that prepares its data, builds the batch of a step,
computes the loss and its metrics, evaluates, and names its metrics.

An objective is an Equinox module. The train step (`eqllm.train.step.TrainStep`) reads only
`loss(model, batch)` (traced inside the compiled step) and, before a step, `check(model, batch)`
on the host. Its array fields (a distillation teacher) are handed to the compiled step as
arguments that are never donated, so a frozen model holds its own arrays and is never a
compile-time constant; its hyperparameters are static fields.

The run side (host code, never traced) lives in `run`, a static field filled by `start`: the
recipe, the prepared data, the run folder and the objective's own state (cached reference
log-probabilities, the current rollouts). A run calls, in order:

1. `prepare(recipe)` (a class method): the data, read and checked in the objective's words;
2. `start(recipe, data, model, folder, write=)`: the objective of the run, starting from
   `model` (before any checkpoint is restored), with what it keeps of the starting model;
3. `batch(step, model)` at every step: a pure function of the recipe, the seed, the step and,
   for RL, the model at that step; `evaluate(model)` at each evaluation.

`metrics` names the step metrics the objective adds (logged to metrics.jsonl and TensorBoard,
plotted in objective.png), `held_out` those `evaluate` returns, `console` those shown by the
progress bar: the one list of each, read by the loop and the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from eqllm.data import Tokenizer
from eqllm.data.chat import read_chat_template
from eqllm.eval.loss import check_token_range
from eqllm.hub import load_tokenizer, resolve
from eqllm.recipe import Recipe, RecipeError
from eqllm.runs import RunFolder
from eqllm.train.balance import forward


class Run:
    """The host side of an objective in a run: never traced (a static field of the objective,
    compared by identity). Objectives subclass it for the state they keep."""

    def __init__(self, recipe: Recipe, data, folder: RunFolder, *, write: bool):
        self.recipe = recipe
        self.data = data
        self.folder = folder
        self.write = write  # this process writes the run folder's files


class Objective(eqx.Module):
    """The base of every objective (see the module docstring)."""

    name: ClassVar[str] = ""
    metrics: ClassVar[tuple[str, ...]] = ()  # step metrics beyond loss (and a MoE's balance)
    held_out: ClassVar[tuple[str, ...]] = ()  # what `evaluate` returns
    console: ClassVar[tuple[str, ...]] = ()  # shown beside the loss by the progress bar
    chat: ClassVar[bool] = False  # the model is prompted with chat turns (samples, run.json)

    run: Any = eqx.field(default=None, static=True, kw_only=True)

    # The step ---------------------------------------------------------------------------------

    def loss(self, model, batch: dict[str, Array]) -> tuple[Float[Array, ""], dict[str, Array]]:
        """(what the step minimises, metrics): traced inside the compiled step, per
        micro-batch. A "ce" metric among them is reported as the step's loss in place of the
        minimised value (the language model's cross entropy, without a mixture of experts'
        balance term)."""
        raise NotImplementedError

    def __call__(self, model, batch: dict[str, Array]) -> tuple[Float[Array, ""], dict]:
        """`loss(model, batch)`: an objective is its loss function too."""
        return self.loss(model, batch)

    def check(self, model, batch: dict) -> None:
        """Host-side checks of a step's batch before it is placed (no device round trip for
        numpy arrays): its token ids fit the model's vocabulary."""
        tokens, config = batch.get("tokens"), getattr(model, "config", None)
        if tokens is None or config is None:
            return
        if np.ndim(tokens) > 2:  # pairs and the like: rows of token ids all the same
            tokens = tokens.reshape(-1, tokens.shape[-1])
        check_token_range(tokens, config.vocab_size)

    # The run ----------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, recipe: Recipe, *, progress: bool = True):
        """The run's data, read, tokenized and checked."""
        raise NotImplementedError

    @classmethod
    def start(cls, recipe: Recipe, data, model, folder: RunFolder, *, write: bool) -> Objective:
        """The objective of the run in `folder`, starting from `model`."""
        raise NotImplementedError

    def batch(self, step: int, model=None) -> dict[str, np.ndarray]:
        """This process's rows of step `step`'s batch."""
        raise NotImplementedError

    def evaluate(self, model) -> dict[str, float]:
        """The objective's own metrics on held-out data (beyond the validation loss)."""
        return {}

    def placed(self, mesh) -> Objective:
        """This objective with its frozen models split over `mesh` as the model is."""
        return self

    def setup_lines(self) -> list[str]:
        """What the run prints about the objective before its first step."""
        return []


# Shared by several objectives ----------------------------------------------------------------


def one_process(what: str) -> None:
    """Refuse a multi-process run for data that is not sharded across processes yet."""
    if jax.process_count() > 1:
        raise RecipeError(f"{what} runs on one process only for now")


def base_tokenizer(recipe: Recipe) -> tuple[Tokenizer, str | None]:
    """(tokenizer, chat template or None) of the base model `model.init_from`; data.tokenizer
    when the base folder has no tokenizer."""
    init_from = recipe.model.init_from
    folder = Path(init_from).expanduser() if RunFolder.is_run(init_from) else resolve(init_from)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        tokenizer = Tokenizer.from_spec(recipe.data.tokenizer)
    return tokenizer, read_chat_template(folder) or tokenizer.chat_template


def token_logps(
    model, tokens: Int[Array, "batch window"], temperature: float = 1.0
) -> Float[Array, "batch window-1"]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) in fp32: the training forward's numbers.
    With `temperature`, those of the distribution sampling draws from: softmax(logits / T)."""
    return routed_logps(model, tokens, temperature)[0]


def routed_logps(
    model, tokens: Int[Array, "batch window"], temperature: float = 1.0
) -> tuple[Float[Array, "batch window-1"], dict[str, Array]]:
    """`token_logps` and the forward's balance terms (`eqllm.train.balance`; {} for a dense
    model)."""
    logits, balance = forward(model, tokens[:, :-1])  # (batch, seq, vocab), fp32
    if temperature != 1.0:
        logits = logits / temperature
    return -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]), balance


def sequence_logps(
    model, tokens: Int[Array, "batch window"], mask: Bool[Array, "batch window-1"]
) -> Float[Array, " batch"]:
    """Summed log-probabilities of each row's masked-in targets (its response)."""
    return jnp.sum(jnp.where(mask, token_logps(model, tokens), 0.0), axis=-1)


def own_copy(model):
    """`model` with arrays of its own: a frozen starting model the train step cannot donate
    (the step reuses the trained model's buffers for its results)."""
    return jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
