"""Config keys as dotted paths: nested dicts of group fields turned into dotted keys
({"attention": {"n_heads": 8}} <-> {"attention.n_heads": 8}) and merged field by field."""

from __future__ import annotations

from typing import Any


def expand(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys ({"attention.n_heads": 8}) turned into nested dicts, merged with the rest."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        head, dot, rest = str(key).partition(".")
        if dot:
            value = expand({rest: value})
        elif isinstance(value, dict):
            value = expand(value)
        if isinstance(out.get(head), dict) and isinstance(value, dict):
            out[head] = merge(out[head], value)
        else:
            out[head] = value
    return out


def dotted(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts flattened to dotted keys ({"attention": {"n_heads": 8}} -> {"attention.n_heads":
    8}); the inverse of `expand`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dotted(value, f"{path}."))
        else:
            out[path] = value
    return out


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied: a dict merges into a dict (field by field), except a RoPE
    scaling of another kind, which replaces the old one; anything else replaces."""
    out = dict(base)
    for key, value in changes.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            other_kind = key == "scaling" and value.get("kind", old.get("kind")) != old.get("kind")
            out[key] = value if other_kind else merge(old, value)
        else:
            out[key] = value
    return out
