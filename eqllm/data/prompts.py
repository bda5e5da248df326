"""Prompts for reinforcement learning: JSONL rows with a `prompt` and any other fields.

A string prompt is continued as it is (no chat template: a base model's own text); a list of
chat messages is rendered with the model's chat template up to the generation prompt. The
other fields go to the reward with the completion (`eqllm.train.rewards`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from eqllm.data.errors import DataError
from eqllm.data.instruct import ChatFormat, as_messages
from eqllm.data.records import read_records
from eqllm.data.tokenizer import Tokenizer


@dataclass
class PromptData:
    """Prompts as token ids (`prompts`, one list per row) with their rows (`examples`)."""

    prompts: list[list[int]]
    examples: list[dict]
    tokenizer: Tokenizer
    template: str | None = None

    @property
    def train(self) -> np.ndarray:
        """The prompts' tokens end to end (what the run's data report counts)."""
        return np.asarray([t for p in self.prompts for t in p], np.int64)

    @property
    def val(self) -> np.ndarray:
        return np.zeros(0, np.int64)  # RL holds no text out: its metric is the reward

    @property
    def meta(self) -> dict:
        return {"train_tokens": int(len(self.train)), "val_tokens": 0, "prompts": len(self.prompts)}

    def bytes_per_token(self, split: str) -> float:
        tokens = self.train
        return len(self.tokenizer.decode(tokens).encode("utf-8")) / max(len(tokens), 1)

    def pick(self, group: int, *, seed: int, count: int) -> np.ndarray:
        """The prompts of rollout batch `group`: a seeded permutation per epoch (pure)."""
        n = len(self.prompts)
        index = np.arange(group * count, (group + 1) * count)
        epochs, within = np.divmod(index, n)
        picks = np.empty(count, np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            picks[epochs == epoch] = order[within[epochs == epoch]]
        return picks


def prepare_prompts(
    path: str | os.PathLike, tokenizer: Tokenizer, *, template: str | None = None
) -> PromptData:
    """Read and tokenize the prompts of a JSONL file (or a JSON list); DataError naming the line
    if bad."""
    chat = ChatFormat(tokenizer, template)
    prompts, examples = [], []
    for row, where in read_records(path, "prompt", "prompts"):
        if not isinstance(row, dict) or "prompt" not in row:
            raise DataError(f"{where}: a row must be a JSON object with a 'prompt'")
        if isinstance(row["prompt"], str):
            if not row["prompt"]:
                raise DataError(f"{where}: 'prompt' is empty")
            ids = chat.encode_text(row["prompt"])
        else:
            messages = as_messages(row["prompt"], "prompt", where, "user")
            ids = chat.encode_text(chat.render(messages, add_generation_prompt=True))
        prompts.append(ids)
        examples.append(row)
    return PromptData(prompts, examples, tokenizer, template)
