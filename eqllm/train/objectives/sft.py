"""Supervised fine-tuning ("sft"): the cross entropy of the responses of finetune.data's
instruction examples (Alpaca or chat form), rendered with the base model's chat template.

Rows are padded one example each, or packed (`finetune.pack`: segment ids keep attention
inside each example, positions restart per example). The batch of step s is a seeded
permutation of the rows per epoch (`eqllm.data.instruct.InstructionData.batch_at`).
"""

from __future__ import annotations

import numpy as np

from eqllm.data.instruct import InstructionData, prepare_instructions
from eqllm.recipe import Recipe, finetune_data_path
from eqllm.runs import RunFolder
from eqllm.train.objectives.base import Run, base_tokenizer, one_process
from eqllm.train.objectives.lm import LanguageModel


class Instructions(LanguageModel):
    """The language model's loss on a batch {"tokens", "mask" (the response targets), and for
    packed rows "segment_ids"}."""

    name = "sft"
    chat = True

    @classmethod
    def prepare(cls, recipe: Recipe, *, progress: bool = True) -> InstructionData:
        """finetune.data's examples, tokenized with the base model's tokenizer and template."""
        tokenizer, template = base_tokenizer(recipe)
        d = recipe.data
        return prepare_instructions(
            finetune_data_path(recipe.finetune.data),
            tokenizer,
            seq_len=d.seq_len,
            template=template,
            val_fraction=d.val_fraction,
            seed=d.split_seed,
            pack=recipe.finetune.pack,
        )

    @classmethod
    def start(
        cls, recipe: Recipe, data: InstructionData, model, folder: RunFolder, *, write: bool
    ) -> Instructions:
        # Packed rows bring their segments and restart positions (as padded rows start at 0).
        return cls(
            reset_positions=data.segment_ids is not None,
            z_loss=recipe.optim.z_loss,
            run=Run(recipe, data, folder, write=write),
        )

    def batch(self, step: int, model=None) -> dict[str, np.ndarray]:
        one_process("finetune.data")
        t = self.run.recipe.train
        return self.run.data.batch_at(step, seed=t.seed, batch_size=t.batch_size)
