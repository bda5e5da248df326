"""`python -m eqllm.sweep.worker SWEEP.toml OUT INDEX`: one point of a sweep in its own process
(what `eqllm sweep --jobs N` starts). Exit status 0 when the point finished or diverged."""

from __future__ import annotations

import sys
from pathlib import Path

from eqllm.hostmem import configure_process
from eqllm.sweep.point import run_point
from eqllm.sweep.spec import load_sweep


def main(argv: list[str]) -> int:
    configure_process()
    sweep_file, out, index = argv
    sweep = load_sweep(sweep_file)
    _, interrupted = run_point(sweep, sweep.points[int(index)], Path(out))
    return {"SIGINT": 130, "SIGTERM": 143}.get(interrupted, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
