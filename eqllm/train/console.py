"""One console for a multi-process run, and a log file per process in the run folder.

Process 0 prints the run's lines and progress as a single process would. Every other process
prints only its warnings and errors, each line prefixed with `[process N]`; everything each
process writes to Python's stdout and stderr also goes to `<run folder>/logs/process-N.log`
(appended to on resume; a progress bar's redrawn line is kept once, as last drawn). Output
the runtime's C++ side writes straight to the file descriptors (XLA, gloo) is not captured.
"""

from __future__ import annotations

import io
import re
import sys
import threading
from pathlib import Path

# A line a non-zero process shows on the console: a warning or an error of any kind.
_LOUD = re.compile(r"warning|error|exception|traceback|fatal", re.IGNORECASE)


class _Tee(io.TextIOBase):
    """A text stream that appends whole lines to a log file and shows some of them."""

    def __init__(self, log, console, *, show_all: bool, prefix: str):
        self._log, self._console = log, console
        self._show_all, self._prefix = show_all, prefix
        self._pending = ""
        self._in_traceback = False
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            if self._show_all:
                self._console.write(text)
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                line = line.rsplit("\r", 1)[-1]  # a progress bar's last drawing of the line
                self._log.write(line + "\n")
                if not self._show_all and self._shows(line):
                    self._console.write(f"{self._prefix}{line}\n")
            self._log.flush()
        return len(text)

    def _shows(self, line: str) -> bool:
        if line.startswith("Traceback"):
            self._in_traceback = True
            return True
        if self._in_traceback:  # a traceback's frames, up to the exception's line
            self._in_traceback = line[:1].isspace()
            return True
        return bool(_LOUD.search(line))

    def flush(self) -> None:
        with self._lock:
            self._console.flush()
            self._log.flush()

    def isatty(self) -> bool:
        return self._show_all and self._console.isatty()

    def fileno(self) -> int:
        return self._console.fileno()


def log_path(out: Path, index: int) -> Path:
    """The log file of process `index` in run folder `out`."""
    return out / "logs" / f"process-{index}.log"


def split_console(out: Path, index: int) -> Path:
    """Route this process's stdout/stderr: all of it to its log file in `out`; to the console
    all of it on process 0, only warnings and errors (prefixed) on the others. Returns the log
    file's path. Stays in place until the process exits."""
    path = log_path(out, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the life of the process
    show_all = index == 0
    prefix = f"[process {index}] "
    sys.stdout = _Tee(log, sys.stdout, show_all=show_all, prefix=prefix)
    sys.stderr = _Tee(log, sys.stderr, show_all=show_all, prefix=prefix)
    return path
