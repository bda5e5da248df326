"""Running a sweep: the token cache first, then the points (one at a time in this process, or
`jobs` worker processes at once), then results.jsonl, results.md and the plots.

Shards (`--shard I/N`) run every N-th point and may run on different machines writing to one
folder; each gathers the results of every finished point it finds, so the last to finish
writes the complete files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from eqllm.sweep.point import run_point
from eqllm.sweep.results import write_results
from eqllm.sweep.spec import Point, Sweep, shard_points
from eqllm.train.setup import prepare_data


def run_sweep(
    sweep: Sweep,
    out: Path,
    *,
    jobs: int = 1,
    shard: tuple[int, int] = (0, 1),
    progress: bool = False,
    echo: Callable[[str], None] = print,
) -> str | None:
    """Run this shard's unfinished points; None when all ran, else the signal that stopped it."""
    out.mkdir(parents=True, exist_ok=True)
    points = shard_points(sweep.points, *shard)
    todo = [p for p in points if not (out / p.name / "result.json").is_file()]
    echo(
        f"sweep {sweep.name}: {len(sweep.points)} points, {len(points)} in shard "
        f"{shard[0]}/{shard[1]}, {len(points) - len(todo)} finished before; folder {out}"
    )
    build_token_caches(sweep, todo, progress=progress, echo=echo)
    if jobs <= 1:
        for point in todo:
            _, interrupted = run_point(sweep, point, out, progress=progress, echo=echo)
            # Each point compiles programs of its own shapes and constants; dropping them keeps
            # a long sweep's memory flat and its process under the kernel's limit on memory
            # mappings (vm.max_map_count), which XLA's CPU code pages count against.
            jax.clear_caches()
            if interrupted:
                return interrupted
    else:
        failed = run_workers(sweep, todo, out, jobs, echo=echo)
        if failed:
            write_results(sweep, out, echo=echo)
            return f"{len(failed)} worker(s) failed: points {', '.join(failed)}"
    write_results(sweep, out, echo=echo)
    return None


def build_token_caches(sweep: Sweep, points: list[Point], *, progress: bool, echo) -> None:
    """Tokenize each distinct data setting once, before any point runs (points running at once
    would otherwise each tokenize the corpus, or train the same BPE, side by side)."""
    seen = set()
    for point in points:
        recipe = sweep.point_recipe(point)
        key = (recipe.data, recipe.finetune.data, recipe.bpe_vocab_size())
        if key in seen:
            continue
        seen.add(key)
        data = prepare_data(recipe, progress=progress)
        echo(f"token cache: {data.meta['train_tokens']:,} training tokens ready")


def run_workers(sweep: Sweep, points: list[Point], out: Path, jobs: int, *, echo) -> list[str]:
    """`jobs` processes at once, one point each (`python -m eqllm.sweep.worker`); each gets its
    own GPUs when there are at least `jobs` of them. Returns the names of failed points."""
    groups = device_groups(jobs)
    waiting = list(points)
    running: dict[subprocess.Popen, tuple[Point, int]] = {}
    failed = []
    free = list(range(jobs))
    while waiting or running:
        while waiting and free:
            point, slot = waiting.pop(0), free.pop(0)
            env = dict(os.environ)
            if groups is not None:
                env["CUDA_VISIBLE_DEVICES"] = groups[slot]
            cmd = [sys.executable, "-m", "eqllm.sweep.worker", str(sweep.path), str(out)]
            proc = subprocess.Popen([*cmd, str(point.index)], env=env)
            running[proc] = (point, slot)
        proc = _wait_any(running)
        point, slot = running.pop(proc)
        free.append(slot)
        if proc.returncode != 0:
            failed.append(point.name)
            echo(f"point {point.name}: worker exited with status {proc.returncode}")
    return failed


def _wait_any(running: dict) -> subprocess.Popen:
    while True:
        for proc in running:
            if proc.poll() is not None:
                return proc
        time.sleep(0.2)


def device_groups(jobs: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each of `jobs` workers, splitting the visible GPUs evenly;
    None when there are fewer GPUs than jobs (the workers then share what there is)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        gpus = [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU")]
    if len(gpus) < jobs:
        return None
    per = len(gpus) // jobs
    return [",".join(gpus[i * per : (i + 1) * per]) for i in range(jobs)]
