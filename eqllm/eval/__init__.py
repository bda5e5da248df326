"""Evaluation: loss, perplexity and bits per byte; text generation (KV cache, compiled decoding)."""

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
from eqllm.eval.harness import (
    bits_per_byte,
    evaluate_tokens,
    loss_report,
    unigram_loss,
)

__all__ = [
    "DecodeState",
    "Sampling",
    "bits_per_byte",
    "evaluate_tokens",
    "filter_logits",
    "forward_cached",
    "generate",
    "generate_batch",
    "init_cache",
    "loss_report",
    "sampling",
    "stream",
    "unigram_loss",
]
