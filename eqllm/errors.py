"""The one error type for bad input.

Anything a user can get wrong (a recipe field, a model name, a config.json, a checkpoint, a
mesh) raises an `EqllmError` subclass whose message is one line naming the thing, the value and
the fix. The command line prints that line and exits with status 2. Every other exception is a
bug and keeps its traceback.
"""

import difflib


class EqllmError(ValueError):
    """Bad input: the message names the field or file, the value and what to do instead."""


def did_you_mean(name: str, options: list[str], n: int = 3) -> str:
    """'did you mean a or b? ' naming the options closest to `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, options, n=n, cutoff=0.5)
    return f"did you mean {' or '.join(close)}? " if close else ""
