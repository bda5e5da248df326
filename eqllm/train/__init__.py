"""Training: optimizer and schedule, the compiled train step, checkpoints, MFU and the loop."""

from .optim import decay_mask, make_optimizer, schedule
from .step import TrainStep, init_opt_state, mean_loss, token_nll

__all__ = [
    "TrainStep",
    "decay_mask",
    "init_opt_state",
    "make_optimizer",
    "mean_loss",
    "schedule",
    "token_nll",
]
