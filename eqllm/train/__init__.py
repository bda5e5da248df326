"""Training: optimizer and schedule, the objectives (`eqllm.train.objectives`, one module each),
the compiled train step (one batch dict, one loss), a mixture of experts' balance terms, the
pipeline schedule, the loop's checkpoints, MFU and the loop.

`mean_loss` and `token_nll` live in `eqllm.eval.loss` and are re-exported here.
"""

from eqllm.eval.loss import mean_loss, token_nll

from .optim import decay_mask, make_optimizer, schedule
from .pipeline import Pipeline
from .step import TrainStep, init_opt_state

__all__ = [
    "Pipeline",
    "TrainStep",
    "decay_mask",
    "init_opt_state",
    "make_optimizer",
    "mean_loss",
    "schedule",
    "token_nll",
]
