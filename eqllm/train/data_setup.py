"""The run's data beyond one corpus: weighted mixtures (`data.sources`) and the train step's
document masking (`data.document_mask`, `data.reset_positions`, packed `finetune.pack`)."""

from __future__ import annotations

import jax
import numpy as np

from eqllm.data import MixtureData, TokenData, batch_at, prepare_mixture
from eqllm.data.instruct import InstructionData
from eqllm.data.prompts import PromptData
from eqllm.recipe import Recipe
from eqllm.recipe.spec import source_label


def prepare_sources(recipe: Recipe, *, progress: bool) -> MixtureData:
    """data.sources, each tokenized into its own cache with the run's tokenizer."""
    d = recipe.data
    sources = [(source_label(s, i), s.to_source(), s.weight) for i, s in enumerate(d.sources)]
    return prepare_mixture(
        sources,
        d.tokenizer,
        seq_len=d.seq_len,
        stages=tuple((stage.step, stage.weights) for stage in d.weight_schedule),
        cache_dir=d.cache_dir or None,
        val_fraction=d.val_fraction,
        seed=d.split_seed,
        bpe_vocab_size=recipe.bpe_vocab_size(),
        progress=progress,
        workers=d.workers,
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


def document_masking(
    recipe: Recipe, data: TokenData | MixtureData | InstructionData | PromptData
) -> dict:
    """TrainStep's masking arguments: segments opened by the end-of-text token on token windows
    (data.document_mask); packed instruction rows bring their own segments and always restart
    positions (as padded rows start at 0); data.reset_positions otherwise. RL prompts have
    none: their rows are the rollouts, one sequence each."""
    if isinstance(data, PromptData):
        return {}
    if isinstance(data, InstructionData):
        return {"reset_positions": data.segment_ids is not None}
    eot = data.tokenizer.eot_id if recipe.data.document_mask else None
    return {"document_token": eot, "reset_positions": recipe.data.reset_positions}
