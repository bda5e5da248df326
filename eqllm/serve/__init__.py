"""Serving: a continuous-batching engine over the model's own prefill/decode (`Engine`) and an
OpenAI-compatible HTTP app on it (`eqllm.serve.app`, started by `eqllm serve`)."""

from eqllm.serve.engine import Engine
from eqllm.serve.request import (
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
