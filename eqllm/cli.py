"""The `eqllm` command line: builds the parser from `eqllm.commands` and dispatches.

Bad input (`EqllmError`) prints `eqllm: error: <message>` on one line and exits 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from eqllm.errors import EqllmError
from eqllm.hostmem import configure_process

# The subcommands, in the order `eqllm --help` lists them; each is a module of eqllm.commands.
COMMANDS = (
    "zoo",
    "convert",
    "generate",
    "run",
    "eval",
    "bench",
    "plan",
    "analyze",
    "coordcheck",
    "sweep",
    "fit",
    "serve",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `command` alone: importing a command's module
    imports what it runs (scipy for fit, FastAPI for serve, ...), seconds that a one-off
    `eqllm generate` should not pay before its first token."""
    parser = argparse.ArgumentParser(prog="eqllm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS if command is None else (command,):
        importlib.import_module(f"eqllm.commands.{name}").add_parser(subparsers)
    return parser


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"eqllm: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    configure_process()  # first: before any command starts JAX's CPU backend
    warnings.showwarning = _print_warning  # one line each, like the errors
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except EqllmError as e:
        message = str(e).replace("\n", " ")  # one line, whatever the message holds
        print(f"eqllm: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
