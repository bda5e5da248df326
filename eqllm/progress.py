"""Progress that reads well wherever it goes: a redrawn tqdm bar on a terminal, and one plain
line every `every` steps (and at the end) when the stream is a file or a pipe, so a log holds
no carriage-return redraws.

    bar = progress_bar(total=1000, desc="train", unit="step", every=10)
    bar.update(1); bar.set_postfix({"loss": "2.31"}); bar.write("eval ..."); bar.close()
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LineProgress:
    """tqdm's `update` / `set_postfix` / `write` / `close`, written as a line every `every`
    steps: ``train 120/1000 step (12%) loss=2.31 tok/s=5,120 | 3.1 step/s, 0:00:39``."""

    def __init__(
        self,
        *,
        total: int | None,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        every: int = 1,
        disable: bool = False,
        file: Any = None,
    ):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.every, self.disable = max(int(every), 1), disable
        self.file = file or sys.stderr
        self.postfix: dict[str, Any] = {}
        self._start, self._start_n, self._shown = time.perf_counter(), initial, initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n // self.every > self._shown // self.every or self.n == self.total:
            self._line()

    def set_postfix(self, postfix: dict[str, Any] | None = None, refresh: bool = True) -> None:
        self.postfix = dict(postfix or {})

    def write(self, text: str, file: Any = None) -> None:
        """Print one line (to `file`, default the bar's stream) even when the bar itself is
        disabled, as `tqdm.write` does: run messages are not progress."""
        print(text, file=file or self.file, flush=True)

    def close(self) -> None:
        if self.n != self._shown:
            self._line()

    def _line(self) -> None:
        self._shown = self.n
        if self.disable:
            return
        elapsed = time.perf_counter() - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        pct = f" ({self.n / self.total:.0%})" if self.total else ""
        post = "".join(f" {k}={v}" for k, v in self.postfix.items())
        clock = time.strftime("%H:%M:%S", time.gmtime(elapsed))
        speed = f"{rate:.3g} {self.unit}/s"
        self.write(f"{self.desc} {self.n}{of} {self.unit}{pct}{post} | {speed}, {clock}")


def progress_bar(
    *,
    total: int | None,
    initial: int = 0,
    desc: str = "",
    unit: str = "it",
    every: int = 1,
    disable: bool = False,
    file: Any = None,
):
    """A tqdm bar when `file` (a text stream; default stderr) is a terminal, else a
    `LineProgress`."""
    file = file or sys.stderr
    if is_terminal(file):
        return tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            disable=disable,
            file=file,
            dynamic_ncols=True,
        )
    return LineProgress(
        total=total, initial=initial, desc=desc, unit=unit, every=every, disable=disable, file=file
    )
