"""Per-token cost of a JSON-schema token mask in the grammar libraries `eqllm serve` could use.

A byte-level BPE of `--vocab` ids (49,152 by default, SmolLM2's size) is trained on the Python
standard library's source, so the vocabulary has the shape real ones have (words, code,
punctuation runs, spaces). For each schema, a valid JSON document is tokenized and walked token
by token: at each position the library computes the mask of allowed next tokens (a 32-bit
bitmask, the form the engine takes) and then accepts the token. Reported: the time to compile
the schema for this vocabulary, and the mean and 95th percentile of mask + accept per token.

Candidates, each only if installed: llguidance (`pip install llguidance`), xgrammar
(`pip install xgrammar`), outlines-core (`pip install outlines-core`).

    PYTHONPATH=$PWD python benchmarks/grammar_mask.py [--vocab 49152]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from eqllm.data import Tokenizer

SCHEMAS = {
    "object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "email", "tags"],
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poet"]},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "order": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "status": {"enum": ["open", "paid", "shipped"]},
                        "items": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "sku": {"type": "string"},
                                    "price": {"type": "number", "minimum": 0},
                                },
                                "required": ["sku", "price"],
                            },
                        },
                    },
                    "required": ["id", "status", "items"],
                }
            },
            "required": ["order"],
        },
        {
            "order": {
                "id": 1042,
                "status": "paid",
                "items": [{"sku": "pen-blue", "price": 1.25}, {"sku": "ink-03", "price": 7.5}],
            }
        },
    ),
}


def train_vocab(size: int) -> Tokenizer:
    files = sorted(Path(json.__file__).parent.parent.rglob("*.py"))
    texts = [f.read_text(errors="ignore") for f in files]
    return Tokenizer.train_bpe(texts, size, min_frequency=2)


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each id's bytes (the ByteLevel alphabet undone)."""
    from eqllm.data.tokenizer import _byte_to_unicode

    back = {c: b for b, c in _byte_to_unicode().items()}
    out = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.hf.id_to_token(i)
        out.append(bytes(back[c] for c in piece) if all(c in back for c in piece) else b"")
    return out


def walk(fill, accept, tokens, words) -> list[float]:
    mask = np.zeros((1, words), np.int32)
    times = []
    for t in tokens:
        start = time.perf_counter()
        fill(mask)
        if not (mask[0, t // 32] >> (t % 32)) & 1:
            raise AssertionError(f"the document's token {t} at {len(times)} was masked out")
        accept(t)
        times.append(time.perf_counter() - start)
    return times


def llguidance_case(tokenizer, schema, tokens, words):
    import llguidance
    import llguidance.numpy

    start = time.perf_counter()
    lt = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=tokenizer.eot_id)
    vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()

    def fill(mask):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)

    times = walk(fill, matcher.consume_token, tokens, words)
    assert matcher.is_accepting()
    return vocab_s, compile_s, times


def xgrammar_case(tokenizer, schema, tokens, words):
    import torch
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo(
        token_bytes(tokenizer),
        vocab_type=xgr.VocabType.RAW,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=[tokenizer.eot_id],
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    bitmask = torch.zeros((1, words), dtype=torch.int32)

    def fill(mask):
        matcher.fill_next_token_bitmask(bitmask)
        mask[:] = bitmask.numpy()

    times = walk(fill, matcher.accept_token, tokens, words)
    return vocab_s, compile_s, times


def outlines_case(tokenizer, schema, tokens, words):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    pieces: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes(tokenizer)):
        if b and i != tokenizer.eot_id:
            pieces.setdefault(b, []).append(i)
    vocab = Vocabulary(tokenizer.eot_id, pieces)
    vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(schema)), vocab)
    guide = Guide(index)
    compile_s = time.perf_counter() - start

    def fill(mask):
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)

    times = walk(fill, guide.advance, tokens, words)
    return vocab_s, compile_s, times


CASES = {"llguidance": llguidance_case, "xgrammar": xgrammar_case, "outlines-core": outlines_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer = train_vocab(args.vocab)
    print(f"vocabulary: {tokenizer.vocab_size} ids ({time.perf_counter() - start:.1f} s to train)")
    words = -(-tokenizer.vocab_size // 32)
    print(
        "| library | schema | tokens | vocab setup s | compile s | mask+accept mean ms | p95 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, case in CASES.items():
        for label, (schema, doc) in SCHEMAS.items():
            tokens = tokenizer.encode(json.dumps(doc, separators=(",", ":")))
            try:
                vocab_s, compile_s, times = case(tokenizer, schema, tokens, words)
            except ImportError as e:
                print(f"| {name} | not installed ({e}) |", file=sys.stderr)
                break
            ms = np.asarray(times) * 1e3
            print(
                f"| {name} | {label} | {len(tokens)} | {vocab_s:.2f} | {compile_s:.3f} | "
                f"{ms.mean():.3f} | {np.percentile(ms, 95):.3f} |"
            )


if __name__ == "__main__":
    main()
