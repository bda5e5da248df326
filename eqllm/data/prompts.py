"""Prompts for reinforcement learning: JSONL rows with a `prompt` and any other fields.

A string prompt is continued as it is (no chat template: a base model's own text); a list of
chat messages is rendered with the model's chat template up to the generation prompt. The
other fields go to the reward with the completion (`eqllm.train.rewards`). A seeded share of
the rows (`val_fraction`) is held out: the run scores its greedy completions at each evaluation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from eqllm.data.errors import DataError
from eqllm.data.instruct import ChatFormat, as_messages
from eqllm.data.records import read_records
from eqllm.data.tokenizer import Tokenizer


@dataclass
class PromptData:
    """Prompts as token ids (`prompts`, one list per row) with their rows (`examples`);
    `val_prompts` and `val_examples` the held-out ones."""

    prompts: list[list[int]]
    examples: list[dict]
    tokenizer: Tokenizer
    template: str | None = None
    val_prompts: list[list[int]] = field(default_factory=list)
    val_examples: list[dict] = field(default_factory=list)

    @property
    def train(self) -> np.ndarray:
        """The prompts' tokens end to end (what the run's data report counts)."""
        return np.asarray([t for p in self.prompts for t in p], np.int64)

    @property
    def val(self) -> np.ndarray:
        return np.zeros(0, np.int64)  # no held-out text: held-out prompts are scored by reward

    @property
    def meta(self) -> dict:
        return {
            "train_tokens": int(len(self.train)),
            "val_tokens": 0,
            "prompts": len(self.prompts),
            "val_prompts": len(self.val_prompts),
        }

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
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    template: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
) -> PromptData:
    """Read and tokenize the prompts of a JSONL file (or a JSON list); DataError naming the line
    if bad. `val_fraction` of them (rounded, chosen by `seed`) are held out."""
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
    order = np.random.default_rng(seed).permutation(len(prompts))
    n_val = int(round(len(prompts) * val_fraction))
    if n_val >= len(prompts):
        raise DataError(
            f"{path}: holding out data.val_fraction={val_fraction} of {len(prompts)} prompts "
            "leaves none to train on; lower data.val_fraction"
        )
    val, train = sorted(order[:n_val]), sorted(order[n_val:])
    return PromptData(
        [prompts[i] for i in train],
        [examples[i] for i in train],
        tokenizer,
        template,
        [prompts[i] for i in val],
        [examples[i] for i in val],
    )
