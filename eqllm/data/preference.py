"""Preference data: pairs of a prompt with a chosen and a rejected response.

A record holds `prompt`, `chosen` and `rejected` (or the columns `fields` names), each a string
or a list of chat messages (`{"role": ..., "content": ...}`), the shape of the common
`*_binarized` preference sets: a string prompt is one user turn, a string response one
assistant turn, and a response list that repeats the prompt's messages first (as
UltraFeedback-binarized's do) has them dropped. The records come from a JSONL file (or a JSON
list) or from a split of a Hugging Face dataset (`eqllm.data.records.read_dataset`).

Each side is rendered with the model's chat template (`eqllm.data.instruct.ChatFormat`): the
prompt up to the generation prompt, then the response, which ends in the end-of-sequence id.
The loss is taken on the response's tokens only. A pair longer than `seq_len + 1` tokens keeps
its start and loses the end of its response (TRL's default `truncation_mode="keep_start"`); a
prompt that leaves no response token in the window is refused, naming the line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from eqllm.data.errors import DataError
from eqllm.data.instruct import ChatFormat, InstructionData, Messages, as_messages, pad_rows
from eqllm.data.records import is_dataset, read_dataset, read_records
from eqllm.data.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")


def to_pair(
    record, where: str, fields: tuple[str, str, str] = FIELDS
) -> tuple[Messages, Messages, Messages]:
    """(prompt, chosen, rejected) messages of one record, read from its `fields` (prompt,
    chosen, rejected); DataError naming `where` if bad."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a pair must be a JSON object, got {type(record).__name__}")
    missing = [k for k in fields if k not in record]
    if missing:
        names = ", ".join(f"preference.{k}_field" for k in FIELDS)
        raise DataError(
            f"{where}: missing field(s) {missing}; a preference pair needs a prompt, a chosen "
            f"and a rejected response (strings or lists of chat messages): set {names} to the "
            f"columns that hold them (the record has {sorted(record)})"
        )
    record = {k: record[f] for k, f in zip(FIELDS, fields, strict=True)}
    prompt = as_messages(record["prompt"], "prompt", where, "user")
    sides = []
    for field in ("chosen", "rejected"):
        response = as_messages(record[field], field, where, "assistant")
        if response[: len(prompt)] == prompt:  # *_binarized sets repeat the prompt
            response = response[len(prompt) :]
        if not response or not any(m["content"].strip() for m in response):
            raise DataError(f"{where}: '{field}' has no response after the prompt; drop the pair")
        if response[-1]["role"] != "assistant":
            raise DataError(f"{where}: '{field}' must end with an assistant message")
        sides.append(response)
    if sides[0] == sides[1]:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' are identical, so the pair prefers nothing; "
            "drop it or fix the rejected response"
        )
    return prompt, sides[0], sides[1]


def read_pairs(
    source: str | os.PathLike, *, split: str = "train", fields: tuple[str, str, str] = FIELDS
) -> list[tuple[Messages, Messages, Messages]]:
    """The pairs of a JSONL file (or a JSON list) or of a dataset's `split` (see the module
    docstring); DataError naming the line or row and the field."""
    return [to_pair(r, w, fields) for r, w in _records(source, split)]


def _records(source: str | os.PathLike, split: str) -> list[tuple[object, str]]:
    if is_dataset(source):
        return read_dataset(source, split, "preference pairs")
    return read_records(source, "preference data", "preference pairs")


def encode_response(
    chat: ChatFormat, prompt: Messages, response: Messages
) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, mask of the response tokens, prompt length in tokens) of prompt + response."""
    head = chat.render(prompt, add_generation_prompt=True)
    full = chat.render(prompt + response)
    if not full.startswith(head):
        raise DataError(
            "the chat template does not render the prompt with its generation prompt as a prefix "
            "of the conversation; eqllm cannot find the response to score"
        )
    prompt_ids = chat.encode_text(head)
    response_ids = chat.encode_text(full[len(head) :].rstrip())
    if not response_ids or response_ids[-1] != chat.tokenizer.eot_id:
        response_ids.append(chat.tokenizer.eot_id)
    ids = np.asarray(prompt_ids + response_ids, np.int64)
    mask = np.arange(len(ids)) >= len(prompt_ids)
    return ids, mask, len(prompt_ids)


@dataclass
class PreferenceData(InstructionData):
    """Preference pairs as rows: `rows`/`mask` are the chosen sides (what the inherited token
    views and evaluation use), `rejected`/`rejected_mask` the rejected ones, each
    [n, seq_len + 1] token ids and [n, seq_len] target masks; `val_*` the held-out pairs.
    `prompts` are the validation prompts' rendered text (for samples)."""

    rejected: np.ndarray | None = None
    rejected_mask: np.ndarray | None = None
    val_rejected: np.ndarray | None = None
    val_rejected_mask: np.ndarray | None = None

    @property
    def meta(self) -> dict:
        return {**super().meta, "train_pairs": len(self.rows), "val_pairs": len(self.val_rows)}

    def pick(self, step: int, *, seed: int, batch_size: int) -> np.ndarray:
        """The training pairs of step `step`: a seeded permutation per epoch (pure in step)."""
        n = len(self.rows)
        index = np.arange(step * batch_size, (step + 1) * batch_size)
        epochs, within = np.divmod(index, n)
        picks = np.empty(batch_size, np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            picks[epochs == epoch] = order[within[epochs == epoch]]
        return picks

    def batch_at(self, step: int, *, seed: int, batch_size: int) -> dict[str, np.ndarray]:
        """Step `step`'s pairs: "tokens" [batch, 2, seq_len + 1] and "mask" [batch, 2, seq_len]
        (chosen, then rejected, of each pair) and "index" [batch], the pairs' numbers."""
        picks = self.pick(step, seed=seed, batch_size=batch_size)
        return self.pairs(picks, split="train")

    def pairs(self, index: np.ndarray, *, split: str) -> dict[str, np.ndarray]:
        """The pairs `index` of a split as one batch (see `batch_at`)."""
        if split == "train":
            c, cm, r, rm = self.rows, self.mask, self.rejected, self.rejected_mask
        else:
            c, cm = self.val_rows, self.val_mask
            r, rm = self.val_rejected, self.val_rejected_mask
        return {
            "tokens": np.stack([c[index], r[index]], axis=1),
            "mask": np.stack([cm[index], rm[index]], axis=1),
            "index": np.asarray(index, np.int64),
        }


def prepare_preferences(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    template: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    split: str = "train",
    fields: tuple[str, str, str] = FIELDS,
) -> PreferenceData:
    """Read, format, tokenize and pad the pairs of `path` (a JSONL file or a dataset's
    `split`, columns `fields`; see the module docstring)."""
    chat = ChatFormat(tokenizer, template)
    encoded = []
    for record, where in _records(path, split):
        prompt, chosen, rejected = to_pair(record, where, fields)
        sides = [encode_response(chat, prompt, side) for side in (chosen, rejected)]
        if sides[0][2] >= seq_len:
            raise DataError(
                f"{where}: the prompt has {sides[0][2]} tokens and leaves no response "
                f"token within data.seq_len={seq_len}; raise data.seq_len or shorten the prompt"
            )
        encoded.append([s[:2] for s in sides])
    order = np.random.default_rng(seed).permutation(len(encoded))
    n_val = int(round(len(encoded) * val_fraction))
    if n_val >= len(encoded):
        raise DataError(f"{path}: {len(encoded)} pairs leave none to train on")
    eot = tokenizer.eot_id
    val, train = order[:n_val], order[n_val:]
    rows, mask, cut = pad_rows([encoded[i][0] for i in train], seq_len, eot)
    rej, rej_mask, rcut = pad_rows([encoded[i][1] for i in train], seq_len, eot)
    val_rows, val_mask, vcut = pad_rows([encoded[i][0] for i in val], seq_len, eot)
    val_rej, val_rej_mask, vrcut = pad_rows([encoded[i][1] for i in val], seq_len, eot)
    return PreferenceData(
        rows,
        mask,
        val_rows,
        val_mask,
        tokenizer,
        cut + rcut + vcut + vrcut,
        template,
        rejected=rej,
        rejected_mask=rej_mask,
        val_rejected=val_rej,
        val_rejected_mask=val_rej_mask,
    )
