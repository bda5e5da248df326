"""Sweeps: many runs of one recipe over a grid or a list of settings (`eqllm sweep`).

Each point is an ordinary run folder inside the sweep folder; a killed sweep resumes where it
stopped, a diverging point stops early and is recorded, shards and jobs spread the points, and
results.jsonl is what `eqllm fit` reads.
"""

from eqllm.sweep.point import count_params, run_point
from eqllm.sweep.results import collect, write_results
from eqllm.sweep.runner import run_sweep
from eqllm.sweep.spec import Point, Sweep, SweepError, load_sweep, parse_shard, shard_points

__all__ = [
    "Point",
    "Sweep",
    "SweepError",
    "collect",
    "count_params",
    "load_sweep",
    "parse_shard",
    "run_point",
    "run_sweep",
    "shard_points",
    "write_results",
]
