"""The architecture families, one file each: `eqllm/families/<name>.py` defines `FAMILY`.

The registry is this package's modules: adding a family is adding a file (see
docs/architecture.md). Everything particular to a family (Hugging Face names, config translation
both ways, the weight key table, invariants) lives in its file; `eqllm.hub` reads them
generically.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from eqllm.config import ConfigError
from eqllm.errors import did_you_mean
from eqllm.families.base import Family, Row

__all__ = ["Family", "Row", "every", "for_model_type", "get", "names"]

_NOT_FAMILIES = {"base"}


@functools.cache
def _families() -> dict[str, Family]:
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_") or module.name in _NOT_FAMILIES:
            continue
        family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        if family.name != module.name:
            raise AssertionError(f"eqllm/families/{module.name}.py defines family {family.name!r}")
        found.append(family)
    return {f.name: f for f in sorted(found, key=lambda f: (f.released, f.name))}


def names() -> list[str]:
    """Family names, oldest first."""
    return list(_families())


def every() -> list[Family]:
    """Every family, oldest first."""
    return list(_families().values())


def get(name: str) -> Family:
    """The family called `name`; an unknown name lists the closest ones."""
    families = _families()
    if name not in families:
        hint = did_you_mean(name, list(families))
        raise ConfigError(f"unknown model family {name!r}; {hint}eqllm has {', '.join(families)}")
    return families[name]


def for_model_type(model_type: str | None) -> Family:
    """The family that reads a Hugging Face config.json with this `model_type`."""
    for family in _families().values():
        if model_type == family.model_type or model_type in family.also_reads:
            return family
    known = sorted(t for f in _families().values() for t in (f.model_type, *f.also_reads))
    raise ConfigError(f"unsupported model_type {model_type!r} in config.json; eqllm reads {known}")
