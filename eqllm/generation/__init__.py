"""Text generation: sampling settings and filters, a compiled prefill + decode loop over the
model's KV cache (`CausalLM.init_cache` / `prefill` / `decode`), streaming, and the public API.

One generation is one `eqx.filter_jit` call: prefill writes the (left-padded) prompts into a
cache with a static number of slots and samples the first new token; a `lax.while_loop` then
feeds each sampled token back, entirely on device, until `max_new_tokens` or until every row
has produced a stop token. Sampling settings are arrays, so changing them does not recompile.
"""

from eqllm.generation.api import bucket, generate, generate_batch, stream
from eqllm.generation.loop import NO_TOKEN, DecodeState
from eqllm.generation.sampling import (
    GenerationError,
    Sampling,
    filter_logits,
    penalize_repetition,
    sample_token,
    sample_tokens,
    sampling,
)

__all__ = [
    "NO_TOKEN",
    "DecodeState",
    "GenerationError",
    "Sampling",
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
