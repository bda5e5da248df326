"""Evaluation of trained models: text generation (KV cache, compiled decoding, sampling)."""

from eqllm.eval.generate import (
    DecodeState,
    Sampling,
    filter_logits,
    forward_cached,
    generate,
    generate_batch,
    init_cache,
    sampling,
    stream,
)

__all__ = [
    "DecodeState",
    "Sampling",
    "filter_logits",
    "forward_cached",
    "generate",
    "generate_batch",
    "init_cache",
    "sampling",
    "stream",
]
