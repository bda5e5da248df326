"""One tokenizer interface over Hugging Face `tokenizers` for every kind of vocabulary.

Kinds:

- ``"bytes"``: the 256 UTF-8 byte values are ids 0..255, ``<|endoftext|>`` is id 256 (vocab 257).
  Decoding any id sequence is lossless for valid UTF-8 and uses U+FFFD for invalid bytes.
- ``"bpe"``: byte-level BPE (GPT-2 style ByteLevel pre-tokenizer and decoder) trained with
  `tokenizers.trainers.BpeTrainer`; ``<|endoftext|>`` is a special token. Deterministic for the
  same documents in the same order.
- ``"pretrained"``: any ``tokenizer.json`` (a file, a folder holding one, or a hub repo id).

`encode` treats special-token strings in the text as plain text (a document that mentions
``<|endoftext|>`` does not get a document boundary) and adds no BOS/EOS: the data pipeline places
the end-of-text token itself. `encode_with_specials` recognises them (for text a chat template
wrote). A loaded tokenizer carries its folder's chat template and special tokens
(`eqllm.data.chat`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .chat import Messages, read_chat_template, render, template_or_default, write_chat_template
from .errors import DataError, DataNotFound
from .sentencepiece import load_sentencepiece

EOT = "<|endoftext|>"
TokenizerKind = Literal["bytes", "bpe", "pretrained"]
_EOT_FALLBACKS = (EOT, "</s>", "<eos>")
# A hub repo's tokenizer files (`Tokenizer.from_pretrained`).
_HUB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
)
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` plus the id of its end-of-text token.

    Build with `Tokenizer.bytes()`, `Tokenizer.train_bpe(...)`, `Tokenizer.load(path)`,
    `Tokenizer.from_pretrained(repo_id)` or `Tokenizer.from_spec(spec)`.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        eot_token: str,
        kind: TokenizerKind,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        eot_id = hf.token_to_id(eot_token)
        if eot_id is None:
            raise DataError(
                f"The end-of-text token {eot_token!r} is not in the tokenizer's vocabulary; "
                "pass a token that is (or add it as a special token)."
            )
        # Special-token strings inside documents are text, not boundaries.
        hf.encode_special_tokens = True
        self.hf = hf
        self.kind: TokenizerKind = kind
        self.eot_token = eot_token
        self.eot_id: int = eot_id
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        # The strings a chat template sees as bos_token, eos_token, ... (tokenizer_config.json).
        self.special_tokens: dict[str, str] = {"eos_token": eot_token, **(special_tokens or {})}
        self._with_specials: tokenizers.Tokenizer | None = None

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    # Constructors -----------------------------------------------------------------------------

    @classmethod
    def bytes(cls) -> Tokenizer:
        """UTF-8 bytes as ids 0..255 plus ``<|endoftext|>`` = 256."""
        vocab = {ch: b for b, ch in _byte_to_unicode().items()}
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        # No regex split: a byte tokenizer needs no word boundaries.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([EOT])
        return cls(hf, EOT, "bytes")

    @classmethod
    def train_bpe(
        cls,
        documents: Iterable[str],
        vocab_size: int,
        *,
        min_frequency: int = 2,
        progress: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE of `vocab_size` ids (``<|endoftext|>`` is id 0) on documents.

        Pairs seen fewer than `min_frequency` times are not merged, so a small corpus can end
        with fewer than `vocab_size` ids. `progress` shows the trainer's own progress bars.
        """
        if vocab_size < 257:
            raise DataError(
                f"bpe_vocab_size={vocab_size} is too small: a byte-level BPE needs the 256 byte "
                "tokens plus <|endoftext|>, so use at least 257 (e.g. 4096 or 32768)."
            )
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress,
        )
        hf.train_from_iterator(documents, trainer=trainer)
        return cls(hf, EOT, "bpe")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a ``tokenizer.json`` file, or a folder holding one or only a SentencePiece
        ``tokenizer.model`` (`eqllm.data.sentencepiece`).

        The end-of-text token is ``eos_token`` from a ``tokenizer_config.json`` beside it if there
        is one, else the SentencePiece model's, else the first of ``<|endoftext|>``, ``</s>``,
        ``<eos>`` in the vocabulary. The folder's chat template comes along
        (`eqllm.data.chat`); so do tokenizer_config.json's ``added_tokens_decoder`` entries a
        SentencePiece model lacks.
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        spm = path / "tokenizer.model" if path.is_dir() else None
        if not file.is_file() and (path / "tiktoken.model").is_file():
            raise DataError(tiktoken_refusal(path))
        if not file.is_file() and not (spm and spm.is_file()):
            raise DataNotFound(
                f"No tokenizer file at {str(file)!r}; expected a tokenizer.json file or a folder "
                "containing one (as written by Tokenizer.save or a Hugging Face model repo), or "
                "a SentencePiece tokenizer.model."
            )
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        config["chat_template"] = read_chat_template(file.parent)
        if file.is_file():
            return cls._from_hf(tokenizers.Tokenizer.from_file(str(file)), config, str(file))
        hf, specials = load_sentencepiece(spm)
        _add_config_tokens(hf, config, str(config_file))
        return cls._from_hf(hf, {**specials, **config}, str(spm))

    @classmethod
    def from_pretrained(cls, repo_id: str, *, revision: str | None = None) -> Tokenizer:
        """Download a hub repo's tokenizer files (``tokenizer.json`` or a SentencePiece
        ``tokenizer.model``, ``tokenizer_config.json``, ``chat_template.jinja``) and `load` them."""
        from huggingface_hub import snapshot_download

        files = list(_HUB_FILES)
        try:
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=files))
        except Exception as e:
            raise DataNotFound(
                f"Could not get the tokenizer of the Hugging Face hub repo {repo_id!r} "
                f"({type(e).__name__}: {e}). Check the repo id and the network (or the offline "
                "cache), or pass a local tokenizer.json path, 'bytes' or 'bpe'."
            ) from e
        if not any((folder / f).is_file() for f in files[:3]):
            raise DataNotFound(
                f"the Hugging Face hub repo {repo_id!r} has neither tokenizer.json nor "
                "tokenizer.model; give a local tokenizer.json path, 'bytes' or 'bpe'"
            )
        return cls.load(folder)

    @classmethod
    def from_spec(cls, spec: str | os.PathLike) -> Tokenizer:
        """``"bytes"``, a tokenizer.json path or folder, or a hub repo id ("org/name").

        ``"bpe"`` needs training documents: use `train_bpe` (or `eqllm.data.prepare`).
        """
        spec_str = os.fspath(spec)
        if spec_str == "bytes":
            return cls.bytes()
        if spec_str == "bpe":
            raise DataError(
                "tokenizer='bpe' must be trained on documents: call Tokenizer.train_bpe(docs, "
                "vocab_size) or eqllm.data.prepare(source, 'bpe', bpe_vocab_size=...)."
            )
        if Path(spec_str).exists():
            return cls.load(spec_str)
        looks_like_path = spec_str.startswith((".", "/", "~")) or spec_str.endswith(".json")
        if looks_like_path or spec_str.count("/") != 1:
            raise DataNotFound(
                f"Tokenizer {spec_str!r} is neither 'bytes', 'bpe', an existing tokenizer.json "
                "file or folder, nor a hub repo id of the form 'org/name'."
            )
        return cls.from_pretrained(spec_str)

    @classmethod
    def _from_hf(cls, hf: tokenizers.Tokenizer, config: dict, where: str) -> Tokenizer:
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not (isinstance(eos, str) and hf.token_to_id(eos) is not None):
            eos = next((t for t in _EOT_FALLBACKS if hf.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(
                f"Cannot find an end-of-text token for the tokenizer at {where}: no eos_token in "
                f"tokenizer_config.json and none of {list(_EOT_FALLBACKS)} in the vocabulary. "
                "Add a tokenizer_config.json with an 'eos_token' beside tokenizer.json."
            )
        kind = config.get("eqllm_kind", "pretrained")
        if kind not in ("bytes", "bpe", "pretrained"):
            kind = "pretrained"
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates (tokenizer_config.json): the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        specials = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[key] = value
        specials["eos_token"] = eos
        return cls(hf, eos, kind, chat_template=template, special_tokens=specials)

    # Use --------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of `text` in which special-token strings (`<|im_end|>`, the end-of-text
        token) are those tokens, as transformers tokenizes a rendered chat template."""
        if self.kind == "bytes":  # only the end-of-text token is special
            ids: list[int] = []
            for i, part in enumerate(text.split(self.eot_token)):
                ids += ([self.eot_id] if i else []) + list(part.encode("utf-8"))
            return ids
        if self._with_specials is None:
            self._with_specials = tokenizers.Tokenizer.from_str(self.hf.to_str())
            self._with_specials.encode_special_tokens = False
        return self._with_specials.encode(text, add_special_tokens=False).ids

    def apply_chat_template(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        template: str | None = None,
        tokenize: bool = True,
    ) -> list[int] | str:
        """The ids (or, with `tokenize=False`, the text) of a conversation as transformers'
        `apply_chat_template` gives them: `template`, else this tokenizer's own, else the
        default (`eqllm.data.chat`)."""
        text = render(
            template_or_default(template or self.chat_template),
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return self.encode_with_specials(text) if tokenize else text

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """The same tokenizer with another chat template (None: the default)."""
        return Tokenizer(
            self.hf,
            self.eot_token,
            self.kind,
            chat_template=template,
            special_tokens=self.special_tokens,
        )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, as int64 arrays; parallel inside `tokenizers` (Rust threads)."""
        if self.kind == "bytes":
            # Same ids as the HF model, ~10x faster: a byte tokenizer is the UTF-8 encoding.
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of `ids`; special tokens are kept as their strings, invalid UTF-8 becomes U+FFFD."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens) and the chat
        template as ``chat_template.jinja`` into the folder `path`.

        Returns the path of ``tokenizer.json``. `Tokenizer.load(path)` reads it back.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / "tokenizer.json"
        self.hf.save(str(file))
        config = {**self.special_tokens, "eos_token": self.eot_token, "eqllm_kind": self.kind}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_chat_template(self.chat_template, folder)
        return file

    def to_str(self) -> str:
        """The tokenizer.json text (a canonical description, used in cache keys)."""
        return self.hf.to_str()


def _add_config_tokens(hf: tokenizers.Tokenizer, config: dict, where: str) -> None:
    """The `added_tokens_decoder` of tokenizer_config.json that `hf` lacks, at their ids."""
    decoder = config.get("added_tokens_decoder") or {}
    for index, token in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        content, index = token["content"], int(index)
        if hf.token_to_id(content) == index:
            continue
        if index != hf.get_vocab_size(with_added_tokens=True):
            raise DataError(
                f"{where}: added token {content!r} has id {index}, but the tokenizer's next id is "
                f"{hf.get_vocab_size(with_added_tokens=True)}; the added_tokens_decoder does not "
                "fit this tokenizer.model"
            )
        hf.add_tokens(
            [
                tokenizers.AddedToken(
                    content,
                    special=bool(token.get("special", False)),
                    normalized=bool(token.get("normalized", not token.get("special", False))),
                    lstrip=bool(token.get("lstrip", False)),
                    rstrip=bool(token.get("rstrip", False)),
                    single_word=bool(token.get("single_word", False)),
                )
            ]
        )


def tiktoken_refusal(folder: Path) -> str:
    """Why a tokenizer shipped as a tiktoken file with remote code (Kimi K2's tiktoken.model and
    tokenization_kimi.py) is not read, and the fix: eqllm runs no repository code, and the file
    alone lacks the pre-tokenizer pattern and special tokens that code defines."""
    return (
        f"{str(folder)!r} holds its tokenizer as tiktoken.model with remote code (the "
        "repository's tokenization_*.py, e.g. Kimi K2's TikTokenTokenizer), which eqllm does not "
        "run; write a tokenizer.json beside it once: `pip install tiktoken`, then "
        "transformers.convert_slow_tokenizer.TikTokenConverter(vocab_file='tiktoken.model', "
        "pattern=TikTokenTokenizer.pat_str, extra_special_tokens=[its special tokens in id "
        "order]).converted().save('tokenizer.json') (check its ids against the remote "
        "tokenizer's), or pass another tokenizer.json"
    )
