"""A run's measurements: metrics.jsonl and TensorBoard rows, throughput, peak memory.

`Throughput` keeps the wall-clock accounting of the loop: the first step's time (compilation
included), the later steps' times, tokens per second over the window since the last log row
(evaluation excluded), and the batch loader's own speed.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from eqllm.runs import RunFolder, atomic_write_text


class MetricsLog:
    """Rows to metrics.jsonl and scalars to TensorBoard event files in the run folder."""

    def __init__(
        self,
        out_dir: Path,
        resume_step: int | None,
        keep_rows: int | None = None,
        *,
        write: bool = True,
    ):
        """resume_step / keep_rows: keep the rows written before the checkpoint resumed from
        (its first `keep_rows` rows, else those up to `resume_step`); the rest are redone.
        `write` False (a process other than 0 of a multi-process run) only counts the rows."""
        self.path = RunFolder(out_dir).metrics_file
        self.rows = 0
        self.file = self.tb = None
        if resume_step is not None and self.path.is_file():
            rows = read_rows(self.path)
            if keep_rows is not None:
                kept = rows[:keep_rows]
            else:
                kept = [r for r in rows if r.get("step", 0) <= resume_step]
            if write:
                atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self.rows = len(kept)
        if not write:
            return
        if resume_step is None and self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(RunFolder(out_dir).file(RunFolder.TENSORBOARD_DIR)))
        except ImportError:  # tensorboardX is a dependency; tolerate its absence anyway
            self.tb = None

    def log(self, row: dict) -> None:
        if self.file is None:  # not the writing process
            self.rows += 1
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.rows += 1
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_rows(path: Path) -> list[dict]:
    """The complete rows of a metrics.jsonl (a line torn by a kill is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a kill; never a complete row
            continue
    return rows


class Throughput:
    """Step times, compile time, tokens/s and loader speed of the steps run in this process."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.loader_s = 0.0
        self.loader_tokens = 0
        self.first_step_s: float | None = None  # includes compiling (or loading it from cache)
        self.compile_s: float | None = None  # first step's time minus the second's
        self.step_times: list[float] = []  # every step after the first
        self.tokens_per_s = 0.0  # over the last window (log row to log row)
        self._window_t0 = time.perf_counter()
        self._window_tokens = 0

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Time building one batch."""
        t0 = time.perf_counter()
        yield
        self.loader_s += time.perf_counter() - t0
        self.loader_tokens += self.tokens_per_step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent here (an evaluation) does not count as training time."""
        t0 = time.perf_counter()
        yield
        self._window_t0 += time.perf_counter() - t0

    def stepped(self, seconds: float) -> dict | None:
        """Record one step; returns the compile-time row once, at the second step."""
        self._window_tokens += self.tokens_per_step
        if self.first_step_s is None:
            self.first_step_s = seconds
            self._window_t0, self._window_tokens = time.perf_counter(), 0
            return None
        self.step_times.append(seconds)
        if self.compile_s is None:
            self.compile_s = max(self.first_step_s - seconds, 0.0)
            return {"compile_s": self.compile_s, "first_step_s": self.first_step_s}
        return None

    def rate(self) -> float:
        """Tokens/s over the current window (since the last `next_window` or the first step)."""
        elapsed = time.perf_counter() - self._window_t0
        if self._window_tokens and elapsed > 0:
            self.tokens_per_s = self._window_tokens / elapsed
        return self.tokens_per_s

    def next_window(self) -> None:
        self._window_t0, self._window_tokens = time.perf_counter(), 0

    def recent_step_s(self, last: float) -> float:
        """Median of the last 50 step times (`last` when only the first step ran)."""
        return float(np.median(self.step_times[-50:])) if self.step_times else last

    @property
    def ran(self) -> bool:
        """Whether any step ran in this process (a run resumed at its end runs none)."""
        return self.first_step_s is not None

    @property
    def step_s(self) -> float:
        if self.step_times:
            return float(np.median(self.step_times))
        return self.first_step_s or 0.0

    @property
    def loader_tokens_per_s(self) -> float:
        return self.loader_tokens / self.loader_s if self.loader_s else float("inf")


def peak_memory() -> tuple[float, str]:
    """(peak bytes, what was measured): device peak where JAX reports it, else host RSS."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return float(stats["peak_bytes_in_use"]), "device peak bytes in use"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss_kb) * 1024, "peak host RSS"
