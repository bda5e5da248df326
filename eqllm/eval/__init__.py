"""Evaluation: loss, perplexity and bits per byte (generation lives in `eqllm.generation`)."""

from eqllm.eval.harness import (
    bits_per_byte,
    evaluate_tokens,
    loss_report,
    unigram_loss,
)

__all__ = [
    "bits_per_byte",
    "evaluate_tokens",
    "loss_report",
    "unigram_loss",
]
