"""Evaluation: loss, perplexity and bits per byte (generation lives in `eqllm.generation`)."""

from eqllm.eval.loss import check_token_range, mean_loss, token_nll
from eqllm.eval.metrics import (
    bits_per_byte,
    evaluate_tokens,
    loss_report,
    unigram_loss,
)

__all__ = [
    "bits_per_byte",
    "check_token_range",
    "evaluate_tokens",
    "loss_report",
    "mean_loss",
    "token_nll",
    "unigram_loss",
]
