"""What a request to the engine is: its settings (`Params`), the events it receives (`PromptScores`,
`Token`, then one `Finished`) and its place in the engine (`Request`); the errors it may raise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from eqllm.errors import EqllmError
from eqllm.generation.sampling import GenerationError, sampling


class ServeError(EqllmError):
    """A request or engine setting the engine cannot serve."""


class QueueFull(ServeError):
    """Every slot is busy and the waiting queue is at its bound."""


@dataclasses.dataclass(frozen=True)
class Params:
    """One request's settings. `seed` None draws a fresh key; with a seed the tokens equal
    `eqllm.generate(..., key=jax.random.key(seed))`. `stop_tokens` end the output (the stop
    token is the last one emitted); `prompt_logprobs` also scores every prompt token; `logprobs`
    sends the TOP_LOGPROBS most likely alternatives with each token (else none); `adapter`
    picks the engine's LoRA adapter (`eqllm.generation.adapters`; 0: the base model)."""

    max_tokens: int
    temperature: float | int = 1.0
    top_k: int | None = None
    top_p: float | int | None = None
    min_p: float | int | None = None
    repetition_penalty: float | int | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    logprobs: bool = False  # each Token carries the most likely alternatives
    adapter: int = 0


@dataclasses.dataclass(frozen=True)
class Token:
    """One generated token, its log-probability and the TOP_LOGPROBS most likely tokens."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Log-probability of each prompt token after the ones before it (None for the first)."""

    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...] | None, ...]


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request is over: reason "stop" (a stop token or a cancel) or "length"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int


class Request:
    """A prompt being served; `sink` receives PromptScores, Token and finally one Finished.

    In the engine it holds a slot and the blocks of its cache (`blocks`, the page table, in
    order; `hashes`: those of its full blocks registered for reuse). `cursor` counts the
    positions of `sequence()` already in the cache: the prompt, then every output token but the
    last (sampled, not fed yet). A preempted request gives its blocks back and, readmitted,
    computes its prompt and output again from the cache or from scratch. `constraint` (None:
    none) masks the tokens it may sample (`eqllm.generation.constrain.Constraint`).
    """

    def __init__(
        self,
        prompt: Sequence[int] | np.ndarray,
        params: Params,
        sink: Callable[[object], None],
        constraint=None,
    ):
        self.prompt = np.asarray(prompt, np.int32)
        self.params = params
        self.sink = sink
        self.constraint = constraint
        self.cancelled = False
        self.slot: int | None = None
        self.key = None  # its PRNG key, set by the engine
        self.admitted = -1  # the order it took its slot in (the latest is preempted first)
        self.cursor = 0
        self.fresh = 0  # the cursor on admission: positions found in the prefix cache
        self.decoding = False  # prefilled: its pending token is fed by the decode step
        self.output: list[int] = []
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.scored = not params.prompt_logprobs  # its PromptScores sent (or none asked for)

    @property
    def produced(self) -> int:
        return len(self.output)

    def sequence(self) -> np.ndarray:
        """The tokens the cache holds or will hold: the prompt, then the output so far."""
        return np.concatenate([self.prompt, np.asarray(self.output, np.int32)])

    def target(self) -> int:
        """Positions to compute before the next token can be sampled: the prompt on admission;
        after a preemption, the prompt and the whole output so far."""
        return len(self.prompt) + len(self.output)

    def cancel(self) -> None:
        """Stop the request at the next step and free its slot (thread-safe)."""
        self.cancelled = True


def check_request(
    prompt: Sequence[int] | np.ndarray, params: Params, *, vocab: int, max_len: int
) -> None:
    """Raise ServeError (GenerationError for sampling values) for a request an engine of
    `vocab` tokens and `max_len` positions cannot run."""
    n = len(prompt)
    if n == 0:
        raise ServeError("prompt is empty; give at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ServeError(f"prompt has token ids outside [0, vocab_size={vocab})")
    if params.max_tokens < 0:
        raise ServeError(f"max_tokens must be >= 0, got {params.max_tokens}")
    if n + params.max_tokens > max_len:
        raise ServeError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"of {max_len} tokens; shorten the prompt or lower max_tokens"
        )
    if params.max_tokens == 0 and not params.prompt_logprobs:
        raise ServeError("max_tokens=0 generates nothing; ask for echo with logprobs or >= 1")
    sampling(
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
    )
    if any(not 0 <= t < vocab for t in params.stop_tokens):
        raise GenerationError(f"stop token ids must lie in [0, vocab_size={vocab})")
