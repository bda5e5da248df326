"""Evaluation: loss, perplexity and bits per byte on text sources; samples for reports."""

from .harness import (
    bits_per_byte,
    evaluate_tokens,
    loss_report,
    naive_sample,
    unigram_loss,
)

__all__ = ["bits_per_byte", "evaluate_tokens", "loss_report", "naive_sample", "unigram_loss"]
