"""The one error type for bad input.

Anything a user can get wrong (a recipe field, a model name, a config.json, a checkpoint, a
mesh) raises an `EqllmError` subclass whose message is one line naming the thing, the value and
the fix. The command line prints that line and exits with status 2. Every other exception is a
bug and keeps its traceback.
"""

import difflib
import json
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails


class EqllmError(ValueError):
    """Bad input: the message names the field or file, the value and what to do instead."""


def did_you_mean(name: str, options: list[str], n: int = 3) -> str:
    """'did you mean a or b? ' naming the options closest to `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, options, n=n, cutoff=0.5)
    return f"did you mean {' or '.join(close)}? " if close else ""


# Messages from pydantic errors (shared with the recipe) --------------------------------------

_TYPES = {
    "int_type": "must be int",
    "int_parsing": "must be int",
    "int_from_float": "must be int",
    "float_type": "must be float",
    "float_parsing": "must be float",
    "finite_number": "must be a finite number",
    "bool_type": "must be bool",
    "bool_parsing": "must be bool",
    "string_type": "must be str",
    "string_too_short": "must be a non-empty string",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dict_type": "must be a table",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "dataclass_type": "must be a table",
    "missing": "is required",
}


def rule(error: ErrorDetails, info: FieldInfo | None = None) -> str:
    """The rule a pydantic error says was broken, in words ("must be positive").

    `info`, the field's FieldInfo, turns a broken bound into the field's whole range.
    """
    kind = error["type"]
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = [
            (name, getattr(m, name))
            for m in (info.metadata if info is not None else [])
            for name in ("gt", "ge", "lt", "le")
            if getattr(m, name, None) is not None
        ]
        return _range(bounds or list(error.get("ctx", {}).items()))
    if kind == "literal_error":
        # pydantic writes "'a', 'b' or 'c'"
        return "must be one of " + ", ".join(error["ctx"]["expected"].rsplit(" or ", 1))
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return _TYPES.get(kind, error["msg"][0].lower() + error["msg"][1:])


def _range(bounds: list[tuple[str, Any]]) -> str:
    lo = next(((n, b) for n, b in bounds if n in ("gt", "ge")), None)
    hi = next(((n, b) for n, b in bounds if n in ("lt", "le")), None)
    if lo and hi:
        left, right = "(" if lo[0] == "gt" else "[", ")" if hi[0] == "lt" else "]"
        return f"must be in {left}{lo[1]}, {hi[1]}{right}"
    if lo == ("gt", 0):
        return "must be positive"
    name, bound = lo or hi
    return f"must be {_SYMBOLS[name]} {bound}"


_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def show(value: Any) -> str:
    """A value as a message shows it: repr for scalars, one-line JSON for lists and tables."""
    try:
        text = json.dumps(value, default=repr) if isinstance(value, (list, tuple, dict)) else None
    except (TypeError, ValueError):  # keys JSON cannot write
        text = None
    text = text or repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
