"""Where a command's time goes: wall time per phase, and JAX's tracing, lowering and XLA
compilation inside each phase (from `jax.monitoring`'s events), for `eqllm generate --timings`.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import jax

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")


class Timings:
    """Phases marked in order (`mark(name)` ends the phase running since the last mark); each
    phase keeps the JAX compile work done in it. `report()` is the table, one line a phase."""

    def __init__(self):
        self.startup = process_age()  # interpreter start and imports, before the first phase
        self.last = time.perf_counter()
        self.totals: Counter = Counter()  # seconds per compile stage, programs, cache hits
        self.phases: list[tuple[str, float, Counter]] = []
        self._seen = Counter()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in _EVENTS:
            self.totals[_EVENTS[event]] += seconds
            self.totals["programs"] += event == "/jax/core/compile/backend_compile_duration"

    def _event(self, event: str, **_) -> None:
        self.totals["cached"] += event == _CACHE_HIT

    def mark(self, name: str) -> float:
        """End the current phase, named `name`; returns its seconds."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.phases.append((name, seconds, self.totals - self._seen))
        self._seen = Counter(self.totals)
        return seconds

    def report(self) -> str:
        lines = []
        if self.startup is not None:
            lines.append(f"  {'startup (interpreter, imports)':<34} {self.startup:7.2f} s")
        for name, seconds, jit in self.phases:
            line = f"  {name:<34} {seconds:7.2f} s"
            if jit["programs"] or jit["trace"] > 0.01:
                line += (
                    f"   trace {jit['trace']:.2f}, lower {jit['lower']:.2f}, XLA compile "
                    f"{jit['compile']:.2f} ({jit['programs']} programs, {jit['cached']} from "
                    "the compilation cache)"
                )
            lines.append(line)
        return "\n".join(lines)

    def time_to_first_token(self) -> float | None:
        """Seconds from the process's start to the end of the phase that printed the first
        token (None without a process start time or such a phase)."""
        names = [name for name, _, _ in self.phases]
        if self.startup is None or "prefill and first token" not in names:
            return None
        upto = names.index("prefill and first token") + 1
        return self.startup + sum(seconds for _, seconds, _ in self.phases[:upto])

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)
