"""`python child.py ARGS...` runs `eqllm ARGS...`, pausing at one point when asked, for kill tests.

EQLLM_PAUSE=PHASE:N pauses at the N-th occurrence in this process of PHASE: "step" (a train
step computed, not yet logged), "eval" (an evaluation during training begins) or "checkpoint"
(a checkpoint's files are written, its commit not yet done: orbax's finalize). It then writes
PHASE to the file EQLLM_PAUSE_MARKER and sleeps, to be killed there.
"""

import os
import sys
import time
from pathlib import Path


def _pause(phase: str) -> None:
    Path(os.environ["EQLLM_PAUSE_MARKER"]).write_text(phase)
    time.sleep(600)


def _counter(phase: str, n: int):
    seen = {"n": 0}

    def hit() -> None:
        seen["n"] += 1
        if seen["n"] == n:
            _pause(phase)

    return hit


def install(spec: str) -> None:
    phase, _, n = spec.partition(":")
    hit = _counter(phase, int(n))
    if phase == "step":
        from eqllm.train.step import TrainStep

        original = TrainStep.__call__

        def step(self, *args):
            out = original(self, *args)
            out[2]["loss"].block_until_ready()
            hit()
            return out

        TrainStep.__call__ = step
    elif phase == "eval":
        from eqllm.train import loop

        original_eval = loop._evaluate  # an evaluation during training

        def evaluate(*args, **kwargs):
            hit()
            return original_eval(*args, **kwargs)

        loop._evaluate = evaluate
    elif phase == "checkpoint":
        from orbax.checkpoint._src.path import atomicity

        original_finalize = atomicity.AtomicRenameTemporaryPath.finalize

        async def finalize(self):
            hit()  # blocks orbax's background commit; training goes on until the kill
            return await original_finalize(self)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    else:
        raise SystemExit(f"EQLLM_PAUSE={spec!r}: unknown phase")


if __name__ == "__main__":
    if os.environ.get("EQLLM_PAUSE"):
        install(os.environ["EQLLM_PAUSE"])
    from eqllm.cli import main

    sys.exit(main(sys.argv[1:]))
