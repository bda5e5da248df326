"""Instruction data: JSON/JSONL examples, chat formatting and loss masks for fine-tuning.

An example is either Alpaca form (`instruction`, optional `input`, `output`) or chat form
(`messages`: a list of `{"role": "system"|"user"|"assistant", "content": ...}`). It is formatted
with the tokenizer's chat template (chat_template.jinja, else tokenizer_config.json's
`chat_template`, rendered as transformers renders it: `eqllm.data.chat`) when there is one, else
with `eqllm.data.chat.DEFAULT_TEMPLATE`:

    <|system|>
    {system message}
    <|user|>
    {user message}
    <|assistant|>
    {assistant message}<eos>

The loss is masked to the assistant turns (their tokens, and the end-of-sequence token after the
last one, inserted if the template does not write it, so that a fine-tuned model learns to
stop). Each example becomes one row of `seq_len + 1` tokens, truncated or padded on the right
with the end-of-sequence id; padding is masked out, and since attention is causal it never
changes the real tokens' logits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from eqllm.data.chat import render, template_or_default
from eqllm.data.errors import DataError
from eqllm.data.packing import pack_examples
from eqllm.data.records import read_records
from eqllm.data.tokenizer import Tokenizer

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")


def read_examples(path: str | os.PathLike) -> list[Messages]:
    """The examples of a JSON (a list) or JSONL (one per line) file, as chat messages.

    Raises DataError naming the file, the line (JSONL) or index (JSON) and the missing field.
    """
    return [to_messages(r, w) for r, w in read_records(path, "instruction data", "examples")]


def as_messages(value, field: str, where: str, role: str | None = None) -> Messages:
    """`value` (a list of messages, or with `role` a string: one turn) as checked chat messages."""
    if isinstance(value, str) and role is not None:
        if not value.strip():
            raise DataError(f"{where}: '{field}' is empty; give it some text or drop the pair")
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: '{field}' must be a non-empty {'string or ' if role else ''}list of chat "
            f"messages, got {type(value).__name__}"
        )
    for i, m in enumerate(value):
        ok = isinstance(m, dict) and m.get("role") in ROLES
        if not ok or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: {field}[{i}] needs 'role' (one of {list(ROLES)}) and a string "
                f"'content', got {m!r}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def to_messages(record, where: str) -> Messages:
    """Chat messages of one Alpaca-form or chat-form record."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: an example must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = as_messages(record["messages"], "messages", where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no 'assistant' message to learn from")
        return messages
    missing = [k for k in ("instruction", "output") if not isinstance(record.get(k), str)]
    if missing:
        raise DataError(
            f"{where}: missing field(s) {missing}; an example needs 'instruction' and 'output' "
            "(Alpaca form, optional 'input') or 'messages' (chat form)"
        )
    prompt = record["instruction"]
    if record.get("input"):
        prompt += "\n\n" + str(record["input"])
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


@dataclass
class ChatFormat:
    """Renders messages as text with a Jinja chat template, and tokenizes them with the loss
    mask. `template` None uses the tokenizer's own, else the default (said once)."""

    tokenizer: Tokenizer
    template: str | None = None

    def __post_init__(self):
        self.template = template_or_default(self.template or self.tokenizer.chat_template)

    def render(self, messages: Messages, *, add_generation_prompt: bool = False, tools=None) -> str:
        return render(
            self.template,
            messages,
            special_tokens=self.tokenizer.special_tokens,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    def encode_text(self, text: str) -> list[int]:
        """Ids of rendered text, special-token strings as their ids (as transformers does)."""
        return self.tokenizer.encode_with_specials(text)

    def encode(self, messages: Messages) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, bool mask of the tokens the loss is taken on) for one conversation.

        The text is cut at the start and end of each assistant turn (found by rendering the
        conversation up to it) and each piece tokenized on its own, so the mask is exact.
        The end-of-sequence id is inserted after the last answer (in the mask) unless the
        template writes it there; the rest of the text follows, tokenized as transformers does.
        """
        full = self.render(messages)
        cuts: list[tuple[int, int]] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self.render(messages[:k], add_generation_prompt=True))
            end = len(self.render(messages[: k + 1]).rstrip())  # the newline after is prompt
            if not full.startswith(self.render(messages[: k + 1])) or start > end:
                raise DataError(
                    "the chat template does not render a conversation as a prefix of its "
                    "continuation; eqllm cannot find the assistant turns to train on"
                )
            cuts.append((start, end))
        ids: list[int] = []
        mask: list[bool] = []
        pos = 0
        for start, end in cuts:
            for piece, train in ((full[pos:start], False), (full[start:end], True)):
                tokens = self.encode_text(piece) if piece else []
                ids += tokens
                mask += [train] * len(tokens)
            pos = end
        eot = self.tokenizer.eot_id
        # The last answer ends with the end-of-sequence token; a template that does not write it
        # gets it appended after the last answer (trained, so the model learns to stop).
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        if not trained or trained[-1] != eot:
            ids.append(eot)
            mask.append(True)
        tail = self.encode_text(full[pos:]) if full[pos:] else []  # as transformers tokenizes
        ids += tail
        mask += [False] * len(tail)
        return np.asarray(ids, np.int64), np.asarray(mask, bool)


@dataclass
class InstructionData:
    """Fine-tuning rows: `rows` [n, seq_len + 1] token ids and `mask` [n, seq_len], True where
    the target `rows[:, 1:]` is a response token. `train` / `val` are the examples' tokens laid
    end to end (what evaluation scores, like a `TokenData`'s)."""

    rows: np.ndarray
    mask: np.ndarray
    val_rows: np.ndarray
    val_mask: np.ndarray
    tokenizer: Tokenizer
    truncated: int  # examples cut to seq_len + 1 tokens
    template: str | None = None  # the chat template the rows were formatted with
    # Packed training rows: the example of each token ([n, seq_len + 1]); None: padded rows.
    segment_ids: np.ndarray | None = None
    filled_tokens: int = 0  # token slots of the training rows that hold an example's token

    @property
    def meta(self) -> dict:
        """What a run reports about its data (as `TokenData.meta` does)."""
        return {
            "train_tokens": int(len(self.train)),
            "val_tokens": int(len(self.val)),
            "train_examples": len(self.rows),
            "val_examples": len(self.val_rows),
            "truncated_examples": self.truncated,
            "padding_fraction": round(self.padding_fraction, 4),
        }

    @property
    def padding_fraction(self) -> float:
        """The share of the training rows' token slots that hold no example's token."""
        return 1.0 - self.filled_tokens / max(self.rows.size, 1)

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes per token of a split's text (for bits per byte)."""
        tokens = self.train if split == "train" else self.val
        return len(self.tokenizer.decode(tokens).encode("utf-8")) / max(len(tokens), 1)

    def chat_prompt(self, text: str) -> str:
        """`text` as a user turn, formatted up to the start of the assistant's answer."""
        chat = ChatFormat(self.tokenizer, self.template)
        return chat.render([{"role": "user", "content": text}], add_generation_prompt=True)

    @property
    def train(self) -> np.ndarray:
        return _flat(self.rows, self.mask)

    @property
    def val(self) -> np.ndarray:
        return _flat(self.val_rows, self.val_mask)

    def batch_at(self, step: int, *, seed: int, batch_size: int) -> dict[str, np.ndarray]:
        """Step `step`'s rows as the train step takes them: {"tokens", "mask"}, rows of a
        seeded permutation per epoch, so a pure function of (seed, step) as the token batches
        are. Packed rows add their "segment_ids"."""
        n = len(self.rows)
        index = np.arange(step * batch_size, (step + 1) * batch_size)
        epochs, within = np.divmod(index, n)
        picks = np.empty(batch_size, np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            picks[epochs == epoch] = order[within[epochs == epoch]]
        batch = {"tokens": self.rows[picks], "mask": self.mask[picks]}
        if self.segment_ids is not None:
            batch["segment_ids"] = self.segment_ids[picks]
        return batch


def _flat(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # Each row's real tokens: up to its last response target (padding follows it).
    out = []
    for row, m in zip(rows, mask, strict=True):
        last = np.flatnonzero(m)
        out.append(row[: (last[-1] + 2) if len(last) else 1])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def pad_rows(
    encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows [n, seq_len + 1], target mask [n, seq_len], examples truncated)."""
    rows = np.full((len(encoded), seq_len + 1), pad_id, np.int64)
    mask = np.zeros((len(encoded), seq_len), bool)
    truncated = 0
    for i, (ids, m) in enumerate(encoded):
        truncated += len(ids) > seq_len + 1
        ids, m = ids[: seq_len + 1], m[: seq_len + 1]
        rows[i, : len(ids)] = ids
        mask[i, : len(ids) - 1] = m[1:]  # target t + 1 is trained when token t + 1 is
    return rows, mask, truncated


def prepare_instructions(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    template: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    pack: str = "none",
) -> InstructionData:
    """Read, format, tokenize and pad the examples of `path` (see the module docstring).

    `pack` "first-fit" or "best-fit" packs the training examples into full rows with segment
    ids (`eqllm.data.packing`); "none" pads one example per row. Validation rows stay padded.
    """
    chat = ChatFormat(tokenizer, template)
    examples = read_examples(path)
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = int(round(len(examples) * val_fraction))
    if n_val >= len(examples):
        raise DataError(f"{path}: {len(examples)} examples leave none to train on")
    encoded = [chat.encode(examples[i]) for i in order]
    train = encoded[n_val:]
    segments = None
    if pack == "none":
        rows, mask, cut = pad_rows(train, seq_len, tokenizer.eot_id)
    else:
        packed = pack_examples(train, seq_len, tokenizer.eot_id, pack)
        rows, mask, cut, segments = packed.rows, packed.mask, packed.truncated, packed.segment_ids
    val_rows, val_mask, val_cut = pad_rows(encoded[:n_val], seq_len, tokenizer.eot_id)
    if not mask.any():
        raise DataError(f"{path}: no response token fits in seq_len={seq_len}; raise data.seq_len")
    filled = sum(min(len(ids), seq_len + 1) for ids, _ in train)
    return InstructionData(
        rows, mask, val_rows, val_mask, tokenizer, cut + val_cut, chat.template, segments, filled
    )
