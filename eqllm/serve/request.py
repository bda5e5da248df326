"""What a request to the engine is: its settings (`Params`), the events it receives (`PromptScores`,
`Token`, then one `Finished`) and its place in the engine (`Request`); the errors it may raise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from eqllm.errors import EqllmError


class ServeError(EqllmError):
    """A request or engine setting the engine cannot serve."""


class QueueFull(ServeError):
    """Every slot is busy and the waiting queue is at its bound."""


@dataclasses.dataclass(frozen=True)
class Params:
    """One request's settings. `seed` None draws a fresh key; with a seed the tokens equal
    `eqllm.generate(..., key=jax.random.key(seed))`. `stop_tokens` end the output (the stop
    token is the last one emitted); `prompt_logprobs` also scores every prompt token."""

    max_tokens: int
    temperature: float | int = 1.0
    top_k: int | None = None
    top_p: float | int | None = None
    min_p: float | int | None = None
    repetition_penalty: float | int | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    prompt_logprobs: bool = False


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
    """A prompt being served; `sink` receives PromptScores, Token and finally one Finished."""

    def __init__(self, prompt: Sequence[int], params: Params, sink: Callable[[object], None]):
        self.prompt = np.asarray(prompt, np.int32)
        self.params = params
        self.sink = sink
        self.cancelled = False
        self.slot: int | None = None
        self.cursor = 0  # prompt tokens already in the cache
        self.produced = 0
        self.scored = not params.prompt_logprobs  # its PromptScores sent (or none asked for)

    def cancel(self) -> None:
        """Stop the request at the next step and free its slot (thread-safe)."""
        self.cancelled = True
