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
from eqllm.eval.loss import check_token_range, mean_loss, token_nll

__all__ = [
    "DecodeState",
    "Sampling",
    "bits_per_byte",
    "check_token_range",
    "evaluate_tokens",
    "filter_logits",
    "forward_cached",
    "generate",
    "generate_batch",
    "init_cache",
    "loss_report",
    "mean_loss",
    "sampling",
    "stream",
    "token_nll",
    "unigram_loss",
]
