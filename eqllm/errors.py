"""The one error type for bad input.

Anything a user can get wrong (a recipe field, a model name, a config.json, a checkpoint, a
mesh) raises an `EqllmError` subclass whose message is one line naming the thing, the value and
the fix. The command line prints that line and exits with status 2. Every other exception is a
bug and keeps its traceback.
"""


class EqllmError(ValueError):
    """Bad input: the message names the field or file, the value and what to do instead."""
