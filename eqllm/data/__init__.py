"""Data pipeline: text sources, tokenizers, cached token files and deterministic batches.

>>> source = DataSource.stdlib(max_bytes=20_000_000)
>>> data = prepare(source, "bpe", bpe_vocab_size=4096)  # cached in ~/.cache/eqllm/tokens
>>> batch = batch_at(data.train, step=0, seed=0, batch_size=16, seq_len=256)
>>> inputs, targets = batch[:, :-1], batch[:, 1:]

The segment helpers (`document_segments`, `document_positions`) load JAX on first use, so the
tokenization worker processes (`eqllm.data.shards`) start without it.
"""

import importlib

from .batches import batch_at, eval_batches
from .errors import DataError, DataNotFound
from .mixture import MixtureData, prepare_mixture, share_tolerance
from .packing import PACK_METHODS, Packed, pack_examples
from .sources import DataSource
from .tokenizer import EOT, Tokenizer
from .tokens import TokenData, default_cache_dir, prepare, split_documents, token_dtype

__all__ = [
    "EOT",
    "MixtureData",
    "PACK_METHODS",
    "Packed",
    "DataError",
    "DataNotFound",
    "DataSource",
    "TokenData",
    "Tokenizer",
    "batch_at",
    "default_cache_dir",
    "document_positions",
    "document_segments",
    "eval_batches",
    "pack_examples",
    "prepare",
    "prepare_mixture",
    "share_tolerance",
    "split_documents",
    "token_dtype",
]


_LAZY = {"document_positions": ".segments", "document_segments": ".segments"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
