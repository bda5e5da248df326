"""Noticing a lost process of a multi-process run, instead of waiting for it forever.

A process killed (SIGKILL, out of memory, its host gone) leaves the others blocked in the
next collective, which on some backends never times out. `Watchdog` runs a thread in every
process that beats a heartbeat into the `jax.distributed` coordination service's key-value
store every second and watches the others': a process whose heartbeat has not changed for
`lost_after` seconds, or that ended with an error, is lost. The first process to see it records
which one in the store, prints one line naming it and the last complete checkpoint, and exits
with status 1 (without unwinding: its main thread may be blocked in a collective); the others
read the record and do the same. A process that ended its run normally marks itself done and
is not waited for. If the coordination service itself is gone (process 0 was lost), the calls
to it fail and the same happens, naming process 0.

JAX's own heartbeat (`heartbeat_timeout_seconds` of `jax.distributed.initialize`, set longer)
stays as the backstop: it aborts a process whose peers stopped answering.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax

_PREFIX = "eqllm/processes"


def _client():
    from jax._src import distributed  # the client jax.distributed.initialize() connected

    return distributed.global_state.client


def last_checkpoint(directory: Path) -> int | None:
    """The newest complete (committed) checkpoint step in `directory`, None when none."""
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps) if steps else None


class Watchdog:
    """A heartbeat per process and a thread that stops this one when another is lost.

    checkpoints: the run's checkpoint folder, named in the message.
    lost_after: seconds without a heartbeat after which a process counts as lost.
    exit: called with the status once the message is printed (default `os._exit`).
    """

    def __init__(
        self,
        checkpoints: Path,
        *,
        lost_after: float,
        interval: float = 1.0,
        exit: Callable[[int], None] = os._exit,
    ):
        self.checkpoints = checkpoints
        self.lost_after = lost_after
        self.interval = min(interval, lost_after / 4)
        self.index, self.count = jax.process_index(), jax.process_count()
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eqllm-watchdog", daemon=True)
        self.fired: str | None = None

    @property
    def grace(self) -> float:
        """Seconds a failed process waits before leaving, and the others before they act on
        its failure (their own error, if they have the same one, then comes first)."""
        return min(5.0, self.lost_after)

    def start(self) -> Watchdog:
        if self.count > 1:
            self._thread.start()
        return self

    def wait(self, seconds: float) -> None:
        """Give the watchdog `seconds` to find a lost process (it then ends this one)."""
        if self._thread.is_alive():
            self._thread.join(seconds)

    def close(self, *, failed: bool = False) -> None:
        """Stop watching and mark this process done (or failed: the others then stop too)."""
        if self.count == 1 or not self._thread.is_alive():
            return
        self._stop.set()
        self._thread.join()
        try:
            _client().key_value_set(
                f"{_PREFIX}/end/{self.index}", "failed" if failed else "done", True
            )
        except Exception:  # the service is gone: nobody is left to tell
            pass

    def _watch(self) -> None:
        client = _client()
        beat = 0
        # process -> (last heartbeat, when it changed); -1 -> {process: when seen failed}
        seen: dict = {}
        unreachable_since = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"{_PREFIX}/alive/{self.index}", str(beat), True)
                lost = self._lost(client, seen, now)
                unreachable_since = None
            except Exception as e:  # the coordination service (in process 0) does not answer
                if self.index == 0:
                    continue
                unreachable_since = unreachable_since or now
                if now - unreachable_since < self.lost_after:
                    continue
                lost = (0, f"the coordination service it runs does not answer ({_first(e)})")
            if lost is not None:
                self._fire(client, *lost)
                return

    def _lost(self, client, seen, now) -> tuple[int, str] | None:
        """(process, why) of a lost process, else None."""
        recorded = _try_get(client, f"{_PREFIX}/lost")
        if recorded is not None:
            index, why = recorded.split(":", 1)
            return int(index), why
        ends = dict(_dir_get(client, f"{_PREFIX}/end/"))
        failed_since = seen.setdefault(-1, {})
        for other in range(self.count):
            if other == self.index:
                continue
            end = ends.get(str(other))
            if end == "done":
                continue
            if end == "failed":
                if now - failed_since.setdefault(other, now) >= self.grace:
                    return other, "it stopped with an error (see its log)"
                continue
            value = _try_get(client, f"{_PREFIX}/alive/{other}") or ""
            last = seen.get(other)
            if last is None or last[0] != value:
                seen[other] = (value, now)
            elif now - last[1] >= self.lost_after:
                silent = f"no heartbeat for {self.lost_after:g} s"
                return other, f"{silent}: killed, crashed or its host lost"
        return None

    def _fire(self, client, index: int, why: str) -> None:
        try:
            client.key_value_set(f"{_PREFIX}/lost", f"{index}:{why}", False)
        except Exception:  # recorded by another process first, or the service is gone
            pass
        step = last_checkpoint(self.checkpoints)
        kept = (
            f"the last complete checkpoint is step {step} in {self.checkpoints}: run the same "
            "command with --resume once every process can start again"
            if step is not None
            else "no checkpoint was completed yet"
        )
        self.fired = (
            f"eqllm: error: process {index} of {self.count} was lost ({why}); process "
            f"{self.index} stops too (exit status 1); {kept}"
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        print(self.fired, file=sys.stderr, flush=True)
        if self.index == 0:  # the others read the record from the service it hosts
            time.sleep(self.grace)
        self._exit(1)


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as e:
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


def _dir_get(client, prefix: str) -> list[tuple[str, str]]:
    return [(k.rsplit("/", 1)[-1], v) for k, v in client.key_value_dir_get(prefix)]
