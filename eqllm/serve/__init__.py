"""Serving: the OpenAI-compatible HTTP app (`eqllm.serve.app`, started by `eqllm serve`) on the
continuous-batching engine every generation runs on (`eqllm.generation.Engine`, re-exported)."""

from eqllm.generation import (
    Engine,
    Finished,
    Params,
    PromptScores,
    QueueFull,
    Request,
    ServeError,
    Token,
)

__all__ = [
    "Engine",
    "Finished",
    "Params",
    "PromptScores",
    "QueueFull",
    "Request",
    "ServeError",
    "Token",
]
