"""A SentencePiece ``tokenizer.model`` (Llama 2, Mistral, Gemma and their fine-tunes) as a
Hugging Face `tokenizers.Tokenizer`, built the way transformers 5 builds its Llama tokenizer from
one: the pieces in id order as a BPE vocabulary with byte fallback, merges ordered by the rank
of the merged piece, a "▁" Metaspace that prefixes the first word only, and the model's control
(`<s>`, `</s>`) and user-defined pieces as added tokens. tests/test_sentencepiece.py checks the
ids against transformers' tokenizer on text with whitespace, unicode and special tokens.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from eqllm.data.errors import DataError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, ordered by the merged piece's
    id (SentencePiece scores BPE pieces by merge order), then by the parts' ids."""
    merges = []
    for piece, rank in vocab.items():
        local = [
            (piece[:i], piece[i:], rank)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in merges]


def load_sentencepiece(file: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, str]]:
    """(tokenizer, special tokens by role: bos_token, eos_token, unk_token, pad_token) of a
    SentencePiece BPE model file."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(file).read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise DataError(f"{file} is not a SentencePiece model ({type(e).__name__}: {e})") from None
    spec = proto.trainer_spec
    if spec.model_type != _BPE:
        raise DataError(
            f"{file}: SentencePiece model_type {spec.model_type} is not supported; eqllm reads "
            "BPE models (model_type 2: Llama, Mistral, Gemma), or give the folder's tokenizer.json"
        )
    pieces = list(proto.pieces)
    unk = spec.unk_id if 0 <= spec.unk_id < len(pieces) else None
    hf = spm_bpe([(p.piece, p.type) for p in pieces], unk_id=unk, byte_fallback=spec.byte_fallback)
    roles = {
        "bos_token": spec.bos_id,
        "eos_token": spec.eos_id,
        "unk_token": spec.unk_id,
        "pad_token": spec.pad_id,
    }
    specials = {k: pieces[i].piece for k, i in roles.items() if 0 <= i < len(pieces)}
    return hf, specials


def spm_bpe(
    pieces: list[tuple[str, int]], *, unk_id: int | None, byte_fallback: bool
) -> tokenizers.Tokenizer:
    """The tokenizer of SentencePiece BPE pieces `(piece, type)` in id order (types as in
    sentencepiece_model.proto: 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    model = models.BPE(
        vocab=vocab,
        merges=_merges(vocab),
        unk_token=pieces[unk_id][0] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=byte_fallback,
        dropout=None,
    )
    hf = tokenizers.Tokenizer(model)
    hf.normalizer = None
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    hf.add_tokens(
        [
            AddedToken(piece, normalized=False, special=kind in (_CONTROL, _UNKNOWN))
            for piece, kind in pieces
            if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
    )
    return hf
