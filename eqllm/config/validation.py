"""Validation shared by ModelConfig, its groups and the recipe sections: frozen pydantic
dataclasses whose errors are one eqllm line naming the dotted path, the value and the rule."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Annotated, Any

import pydantic
from pydantic import ConfigDict, Field, ValidationError

from eqllm.errors import EqllmError, rule, show

Positive = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

# strict: no "3" -> 3 or 64.0 -> 64; an int is still accepted where a float is expected.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ConfigError(EqllmError):
    """An invalid configuration value; the message names the field, the value and the rule."""


def validated(config: ConfigDict, error: Callable[[ValidationError, type], Exception]):
    """Class decorator: a frozen pydantic dataclass (hashable, compared by value, cheap to build).

    A ValidationError of its constructor becomes `error(validation_error, cls)`, one line of
    eqllm's error type. Validation of a nested value (`TypeAdapter`) does not pass through the
    constructor and raises the ValidationError itself.
    """

    def wrap(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(frozen=True, config=config)(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            prepare = getattr(cls, "_prepare", None)
            if prepare is not None:
                kwargs = prepare(kwargs)
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise error(e, cls) from None

        cls.__init__ = __init__
        return cls

    return wrap


def config_error(error: ValidationError, cls: type) -> ConfigError:
    """One ConfigError line for the first problem pydantic found in a config or a group."""
    path = getattr(cls, "PATH", cls.__name__)
    first = error.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, EqllmError):  # raised by __post_init__ with its own message
        return ConfigError(str(cause))
    name = str(first["loc"][0]) if first["loc"] else ""
    if first["type"] == "missing":
        missing = [str(e["loc"][0]) for e in error.errors() if e["type"] == "missing"]
        return ConfigError(f"{path} is missing required field(s) {', '.join(missing)}")
    if first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return unknown_field(cls, name)
    if first["type"] in ("dataclass_type", "dataclass_exact_type"):
        return ConfigError(f"{path}.{name}={show(first['input'])} must be a table")
    info = cls.__pydantic_fields__.get(name)
    return ConfigError(f"{path}.{name}={show(first['input'])} {rule(first, info)}")


def unknown_field(cls: type, key: Any) -> ConfigError:
    """'unknown ModelConfig.attention field ...; did you mean ...? valid fields: ...'."""
    names = list(cls.__pydantic_fields__)
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    path = getattr(cls, "PATH", cls.__name__)
    return ConfigError(f"unknown {path} field {key!r}; {hint}valid fields: {', '.join(names)}")


def require(ok: bool, path: str, value: Any, broken: str) -> None:
    """Raise `ConfigError("<path>=<value> <broken>")` unless `ok`."""
    if not ok:
        raise ConfigError(f"{path}={show(value)} {broken}")
