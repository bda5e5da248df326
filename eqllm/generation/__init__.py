"""Text generation: sampling settings and filters, the continuous-batching engine over a paged
KV cache (`Engine`), and the public API on it (`generate`, `generate_batch`, `stream`).

Every generation in eqllm (these functions, evaluation samples, the lm-evaluation-harness
backend, GRPO rollouts, `eqllm serve`) runs on the one engine: the model's own `prefill` /
`decode` over views of a pool of cache blocks, one compiled prefill step and one compiled decode
step that loops on device until its tokens are drawn or every row produced a stop token.
Sampling settings are arrays, so changing them does not recompile. With `speculate=K` the
decode step is a speculative round (guesses from prompt lookup or a draft model, verified in
one target call; `eqllm.generation.speculate`).
"""

from eqllm.generation.api import bucket, generate, generate_batch, stream
from eqllm.generation.engine import Engine
from eqllm.generation.requests import (
    Finished,
    Params,
    PromptScores,
    QueueFull,
    Request,
    ServeError,
    Token,
)
from eqllm.generation.sampling import (
    GenerationError,
    Sampling,
    filter_logits,
    penalize_repetition,
    sample_token,
    sample_tokens,
    sampling,
)
from eqllm.generation.steps import NO_TOKEN

__all__ = [
    "NO_TOKEN",
    "Engine",
    "Finished",
    "GenerationError",
    "Params",
    "PromptScores",
    "QueueFull",
    "Request",
    "Sampling",
    "ServeError",
    "Token",
    "bucket",
    "filter_logits",
    "generate",
    "generate_batch",
    "penalize_repetition",
    "sample_token",
    "sample_tokens",
    "sampling",
    "stream",
]
