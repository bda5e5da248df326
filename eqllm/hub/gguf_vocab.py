"""The vocabulary of a GGUF file both ways: byte-level BPE written as llama.cpp's "gpt2"
vocabulary (tokens, types, merges, special ids, chat template); "gpt2", "llama"
(SentencePiece BPE) and "gemma4" (Gemma 4's BPE) vocabularies read back as an eqllm Tokenizer."""

from __future__ import annotations

import json

import tokenizers

from eqllm.config import ConfigError
from eqllm.data.sentencepiece import spm_bpe
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub.files import CheckpointError


def write_tokenizer(writer, gguf, tokenizer: Tokenizer) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" vocabulary."""
    data = json.loads(tokenizer.to_str())
    if data["model"]["type"] != "BPE" or (data.get("pre_tokenizer") or {}).get("type") not in (
        "ByteLevel",
        None,
    ):
        raise ConfigError(
            "eqllm writes byte-level BPE tokenizers (GPT-2 style) into GGUF files; convert with "
            "a tokenizer of that kind, or leave it out"
        )
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    types = [
        (gguf.TokenType.CONTROL if added[t].get("special") else gguf.TokenType.USER_DEFINED)
        if t in added
        else gguf.TokenType.NORMAL
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eot_id)
    bos = tokenizer.special_tokens.get("bos_token")
    if bos is not None and tokenizer.hf.token_to_id(bos) is not None:
        writer.add_bos_token_id(tokenizer.hf.token_to_id(bos))
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def gemma_bpe(tokens: list[str], types: list[int], merges: list[str]) -> tokenizers.Tokenizer:
    """Gemma 4's vocabulary as llama.cpp's converter writes it ("gemma4": the tokens and merges
    of its tokenizer.json): BPE with byte fallback, spaces as ▁ and no space put in front, as
    transformers' GemmaTokenizer builds it from the same file; control tokens special and
    user-defined ones (the converter's tool-call markers) whole."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

    unk = "<unk>" if "<unk>" in tokens else None
    hf = tokenizers.Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    hf.add_tokens(
        [
            AddedToken(t, special=k == 3, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in (3, 4)
        ]
    )
    return hf


def read_tokenizer(field, path) -> Tokenizer | None:
    """The vocabulary of a GGUF file: "gpt2" (byte-level BPE), "llama" (SentencePiece BPE) or
    "gemma4" (Gemma 4's BPE, `gemma_bpe`)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    kind = field("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(field("tokenizer.ggml.tokens"))
    types = [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))]
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        hf = tokenizers.Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        )
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_tokens(
            [
                AddedToken(t, special=k == 3, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k in (3, 4)
            ]
        )
    elif kind == "gemma4":
        hf = gemma_bpe(tokens, types, list(field("tokenizer.ggml.merges", [])))
    elif kind == "llama":
        unk = field("tokenizer.ggml.unknown_token_id")
        hf = spm_bpe(list(zip(tokens, types, strict=True)), unk_id=unk, byte_fallback=6 in types)
    else:
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported")
    specials = {}
    for role in ("bos", "eos", "unknown", "padding"):
        i = field(f"tokenizer.ggml.{role}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(role, role)
            specials[f"{key}_token"] = tokens[int(i)]
    if "eos_token" not in specials:
        raise CheckpointError(f"{path}: the GGUF tokenizer has no eos_token_id")
    return Tokenizer(
        hf,
        specials["eos_token"],
        "pretrained",
        chat_template=field("tokenizer.chat_template"),
        special_tokens=specials,
    )
