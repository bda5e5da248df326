"""RecipeError, and pydantic's validation errors rewritten as one RecipeError line.

The line names the key path (`train.batch_size`, `eval.extra_sources[0].path`), the value and
the rule; an unknown key lists the allowed ones with a "did you mean" where one is close.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, get_args

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from eqllm.config import rule, show
from eqllm.errors import EqllmError


class RecipeError(EqllmError):
    """An invalid recipe; the message names the key path, the value and what is allowed."""


_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def recipe_error(error: ValidationError, root: type, prefix: str = "") -> RecipeError:
    """The first problem of `error` (unknown keys first) as one line.

    root: the model that was validated; prefix: what its key paths start with ("" for a recipe).
    """
    errors = error.errors(include_url=False)
    first = next((e for e in errors if e["type"] in _UNKNOWN), errors[0])
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, EqllmError):  # a check that wrote its own message
        return RecipeError(str(cause))
    loc = first["loc"]
    path = prefix + _dotted(loc)
    where = prefix + _dotted(loc[:-1]) if loc[:-1] else (prefix.rstrip(".") or "the recipe")
    parent = _parent(root, loc)
    if first["type"] in _UNKNOWN:
        names = _field_names(parent)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
        base = path[: len(path) - len(str(loc[-1]))]
        hint = f"did you mean '{base}{close[0]}'? " if close else ""
        return RecipeError(f"unknown key '{path}' in {where}; {hint}allowed: {', '.join(names)}")
    if first["type"] == "missing":
        return RecipeError(f"{where} is missing the required key '{path}'")
    if cause is not None:  # a ValueError of a section's own constructor
        return RecipeError(f"{path or where}: {cause}")
    info = _field_info(parent, loc[-1]) if loc else None
    return RecipeError(f"{path}={show(first['input'])} {rule(first, info)}")


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _parent(root: type, loc: tuple[int | str, ...]) -> Any:
    """The type that holds the last key of `loc` (a model, a dataclass or a tuple's item)."""
    tp = root
    for part in loc[:-1]:
        if isinstance(part, int):
            args = get_args(tp)
            tp = args[0] if args else None
        else:
            info = _field_info(tp, part)
            tp = info.annotation if info is not None else None
    return tp


def _field_info(tp: Any, name: Any) -> FieldInfo | None:
    return getattr(tp, "__pydantic_fields__", {}).get(name)


def _field_names(tp: Any) -> list[str]:
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    return []
