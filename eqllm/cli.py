"""The `eqllm` command line: builds the parser from `eqllm.commands` and dispatches.

Bad input (`EqllmError`) prints `eqllm: error: <message>` on one line and exits 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from eqllm.commands import (
    analyze,
    bench,
    convert,
    coordcheck,
    fit,
    generate,
    run,
    serve,
    sweep,
    zoo,
)
from eqllm.commands import eval as eval_
from eqllm.errors import EqllmError
from eqllm.hostmem import configure_process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eqllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (
        zoo,
        convert,
        generate,
        run,
        eval_,
        bench,
        analyze,
        coordcheck,
        sweep,
        fit,
        serve,
    ):
        command.add_parser(commands)
    return parser


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"eqllm: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    configure_process()  # first: before any command starts JAX's CPU backend
    warnings.showwarning = _print_warning  # one line each, like the errors
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EqllmError as e:
        message = str(e).replace("\n", " ")  # one line, whatever the message holds
        print(f"eqllm: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
