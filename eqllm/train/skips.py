"""What the training loop does with a step the train step did not apply: a non-finite one
(skipped while train.skip_nonfinite allows, else the run stops with `NonFiniteLoss`) and a
spiking one (optim.skip_spike_window: logged and counted)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from eqllm.errors import EqllmError

if TYPE_CHECKING:
    from eqllm.train.setup import RunSetup


class NonFiniteLoss(EqllmError):
    """The loss or gradient norm became inf/NaN; the step was not applied and the run stopped.

    Bad input in the sense that the fix is in the recipe or the data (learning rate, warm-up,
    `train.skip_nonfinite`); the message says which step and which checkpoint is intact.
    """


@dataclasses.dataclass
class RunState:
    """The loop's counters: where it is, what it skipped, why it stopped early."""

    step: int
    skipped: int = 0  # non-finite steps skipped so far (train.skip_nonfinite)
    spikes: int | None = None  # spiking steps skipped so far (optim.skip_spike_window)
    interrupted: str | None = None
    interrupted_by: int | None = None  # the process that received the signal


def skip_or_stop(setup: RunSetup, state: RunState, loss: float, bar) -> None:
    """A non-finite step (not applied): skip it while train.skip_nonfinite allows, else raise
    `NonFiniteLoss` naming the last good checkpoint."""
    allowed = setup.recipe.train.skip_nonfinite
    if state.skipped < allowed:
        state.skipped += 1
        setup.log.log({"step": state.step, "loss": loss, "finite": False, "skipped": state.skipped})
        bar.write(
            f"step {state.step}: non-finite loss ({loss}) or gradient norm; the update was not "
            f"applied and the batch skipped ({state.skipped} of train.skip_nonfinite={allowed})",
            file=sys.stderr,
        )
        return
    last_saved = setup.checkpoints.last_saved
    where = (
        f"the last good checkpoint is step {last_saved} in {setup.checkpoints.directory}"
        if last_saved is not None
        else "no checkpoint was saved before it"
    )
    setup.log.log({"step": state.step, "loss": loss, "finite": False})
    skip = (
        f"after skipping {state.skipped} (train.skip_nonfinite={allowed})"
        if state.skipped
        else "set train.skip_nonfinite=K to skip up to K such steps"
    )
    raise NonFiniteLoss(
        f"non-finite loss ({loss}) or gradient norm at step {state.step}; the update was not "
        f"applied and the run stopped ({skip}). {where}. Lower optim.lr, raise "
        "optim.warmup_steps or check the data."
    )


def spike(setup: RunSetup, state: RunState, loss: float, metrics, bar) -> None:
    """Count the spiking steps skipped (optim.skip_spike_window); log one that was."""
    state.spikes = int(metrics["spikes"])
    if bool(metrics["spike"]):
        setup.log.log({"step": state.step, "loss": loss, "spike": True, "spikes": state.spikes})
        bar.write(
            f"step {state.step}: loss {loss:.4f} or gradient norm spiked past the rolling "
            f"threshold (optim.skip_spike_*); the update was not applied ({state.spikes} so far)",
            file=sys.stderr,
        )
