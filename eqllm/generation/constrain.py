"""Constrained decoding: a per-request mask of the tokens a grammar allows next.

A constrained request carries a `Constraint` (its grammar's state). Before each step that
samples its next token, the engine asks it for a bitmask of the allowed tokens (32 tokens per
int32 word, bit `t % 32` of word `t // 32`, as llguidance and xgrammar lay it out); every other
row gets all bits set. The compiled steps take the masks of all rows as one array argument of a
fixed shape, so requests with and without a constraint share a batch and nothing recompiles.
The mask sets disallowed logits to -inf before the repetition penalty, the filters and the
choice, so greedy and sampled decoding both respect it; the log-probabilities reported are the
model's own. Each emitted token advances the constraint; once its grammar has ended, the
request stops. A decode call runs one token at a time while any slot is constrained.

The grammars come from llguidance (Microsoft's Rust library behind Guidance; `Grammars`): JSON
schemas and Lark grammars compiled against the tokenizer's own vocabulary. It was chosen over
xgrammar and outlines-core by per-token cost and footprint (docs/serve.md, "Structured output").
"""

from __future__ import annotations

import json
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eqllm.data import Tokenizer
from eqllm.generation.requests import ServeError

INSTALL = "pip install 'eqllm[serve]' (or: pip install llguidance)"
# JSON without free whitespace: a weak model otherwise spends its tokens on spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}


def mask_words(vocab: int) -> int:
    """int32 words of a bitmask over `vocab` tokens."""
    return -(-vocab // 32)


def all_allowed(rows: int, vocab: int) -> np.ndarray:
    """Bitmasks that allow every token (the rows of requests without a constraint)."""
    return np.full((rows, mask_words(vocab)), -1, np.int32)


def masked_logits(
    logits: Float[Array, "*rows vocab"], bitmask: Int[Array, "*rows words"]
) -> Float[Array, "*rows vocab"]:
    """`logits` with every token whose bit is clear at -inf (a row that allows nothing is left
    as it is, rather than sampled from nothing)."""
    vocab = logits.shape[-1]
    bits = jnp.right_shift(bitmask[..., None], jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab].astype(bool)
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed, logits, -jnp.inf)


def refuse_speculation(constraint: object | None, speculator: object | None) -> None:
    """A constrained request cannot run on an engine that speculates: its guesses would need the
    grammar's mask at every guessed position."""
    if constraint is not None and speculator is not None:
        raise ServeError(
            "structured output (response_format, tool_choice required or named) is not "
            "available on a server started with --speculate; start it without --speculate"
        )


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ServeError(f"structured output needs the llguidance package: {INSTALL}") from None
    return llguidance


class Constraint:
    """One request's grammar state (an llguidance matcher) over `vocab` token ids."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self._mask = np.zeros(mask_words(vocab), np.int32)

    def fill(self, row: np.ndarray) -> None:
        """Write the bitmask of the allowed next tokens into `row` (int32 words)."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        n = min(len(row), len(self._mask))
        row[:n] = self._mask[:n]
        row[n:] = 0

    def accept(self, token: int) -> None:
        """Advance past an emitted token."""
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar has ended (its stop token was taken) or cannot go on."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class Grammars:
    """Grammars over one tokenizer's vocabulary, padded to the model's `vocab` ids.

    The vocabulary is prepared once per set of stop tokens (~0.2 s for 49k tokens): a grammar
    that has ended allows only those.
    """

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.llguidance = _llguidance()
        self.tokenizer, self.vocab = tokenizer, max(vocab, tokenizer.vocab_size)
        self._vocabularies: dict[tuple[int, ...], Any] = {}

    def _vocabulary(self, stops: tuple[int, ...]):
        stops = stops or (self.tokenizer.eot_id,)
        if stops not in self._vocabularies:
            self._vocabularies[stops] = self.llguidance.LLTokenizer(
                self.tokenizer.to_str(), n_vocab=self.vocab, eos_token=list(stops)
            )
        return self._vocabularies[stops]

    def json_schema(self, schema: dict | None, *, field: str = "response_format") -> str:
        """The grammar of JSON text valid against `schema` (None: any JSON object); ServeError
        naming `field` when the schema is not one llguidance can compile."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ServeError(f"{field}: the JSON schema must be an object, got {schema!r}")
        try:
            grammar = self.llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_OPTIONS
            )
        except ValueError as e:
            raise ServeError(f"{field}: invalid JSON schema: {e}") from None
        return self._checked(grammar, field)

    def tool_calls(self, call: dict, *, many: bool, field: str = "tools") -> str:
        """The grammar of one tool call (or, with `many`, one or more) in the Hermes / Qwen
        form, `<tool_call>{...}</tool_call>` blocks (a newline may follow the open tag, precede
        the close tag and part two blocks, as Qwen's template writes them), each block's JSON
        valid against the schema `call`; ServeError naming `field` when it does not compile."""
        payload = json.dumps({**call, "x-guidance": JSON_OPTIONS})
        calls = 'call ("\\n"? call)*' if many else "call"
        lark = (
            f"start: {calls}\n"
            'call: "<tool_call>" "\\n"? payload "\\n"? "</tool_call>"\n'
            f"payload: %json {payload}\n"
        )
        return self._checked(self.llguidance.LLMatcher.grammar_from_lark(lark), field)

    def _checked(self, grammar: str, field: str) -> str:
        failed, messages = self.llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._vocabulary(())
        )
        if failed:
            raise ServeError(f"{field}: invalid JSON schema: {messages[0]}".splitlines()[0])
        return grammar

    def constraint(self, grammar: str, stops: tuple[int, ...]) -> Constraint:
        """A fresh state of `grammar` for one request that stops at `stops`."""
        matcher = self.llguidance.LLMatcher(self._vocabulary(tuple(stops)), grammar, log_level=0)
        if matcher.is_error():
            raise ServeError(f"the grammar does not compile: {matcher.get_error()}")
        return Constraint(matcher, self.vocab)
