"""The model zoo: named architectures read from the TOML tables in zoo/<family>.toml.

Each file has a `[defaults]` table shared by the family and one table per sized variant. A
variant may name the published model it mirrors with `source = "org/name"`; every other key is
a `ModelConfig` field or a dotted path into one of its groups (`attention.n_heads = 8`), merged
into the defaults setting by setting. Nothing registers itself at import time: the files are the
registry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import tomllib
from jaxtyping import PRNGKeyArray

from eqllm import families
from eqllm.config import ConfigError, ModelConfig, merge
from eqllm.errors import did_you_mean
from eqllm.model import CausalLM
from eqllm.nn import ExpertLinear
from eqllm.resources import data_dir
from eqllm.trees import param_count as _count

_META_KEYS = ("source",)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """A named variant: its config and the published model it mirrors ('' for none)."""

    name: str
    config: ModelConfig
    source: str


@functools.cache
def _entries() -> dict[str, ZooEntry]:
    entries: dict[str, ZooEntry] = {}
    order = families.names()  # oldest family first
    paths = sorted(
        data_dir("zoo").glob("*.toml"),
        key=lambda p: (order.index(p.stem) if p.stem in order else len(order), p.stem),
    )
    for path in paths:
        with path.open("rb") as f:
            tables = tomllib.load(f)
        defaults = tables.pop("defaults", {})
        for name, table in tables.items():
            values: dict[str, Any] = merge(defaults, table)
            meta = {k: values.pop(k, "") for k in _META_KEYS}
            if name in entries:
                raise ConfigError(f"zoo variant {name!r} is defined twice (again in {path.name})")
            try:
                config = ModelConfig.from_dict(values)
                families.get(config.family)
            except ConfigError as e:
                raise ConfigError(f"zoo variant {name!r} in {path.name}: {e}") from None
            entries[name] = ZooEntry(name, config, meta["source"])
    return entries


def names() -> list[str]:
    """All variant names, in file order (family by family, small to large)."""
    return list(_entries())


def entry(name: str) -> ZooEntry:
    """The zoo entry called `name`; an unknown name lists the closest ones."""
    entries = _entries()
    if name not in entries:
        hint = did_you_mean(name, list(entries))
        raise ConfigError(
            f"unknown zoo model {name!r}; {hint}`eqllm zoo list` shows all {len(entries)} names"
        )
    return entries[name]


def config(name: str, **overrides: Any) -> ModelConfig:
    """The frozen config of variant `name`, with `overrides` applied (unknown fields rejected;
    see `ModelConfig.replace`: `attention={"n_kv_heads": 1}` or `**{"attention.n_kv_heads": 1}`)."""
    return entry(name).config.replace(**overrides) if overrides else entry(name).config


def create(name: str, *, key: PRNGKeyArray, **overrides: Any) -> CausalLM:
    """A freshly initialised model of variant `name`."""
    return CausalLM(config(name, **overrides), key=key)


def param_count(name_or_config: str | ModelConfig) -> int:
    """Exact parameter count, computed from shapes alone (no memory is allocated)."""
    cfg = config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    shapes = eqx.filter_eval_shape(CausalLM, cfg, key=jax.random.key(0))
    return _count(shapes)


def active_param_count(name_or_config: str | ModelConfig) -> int:
    """Parameters one token uses: all of them, less the routed experts it does not reach
    (n_experts - experts_per_token of them in each layer with experts: their projections,
    gated or not, and biases, read from the model's shapes)."""
    cfg = config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    shapes = eqx.filter_eval_shape(CausalLM, cfg, key=jax.random.key(0))
    total = _count(shapes)
    if cfg.moe is None:
        return total
    is_experts = lambda node: isinstance(node, ExpertLinear)  # noqa: E731
    experts = [x for x in jax.tree.leaves(shapes, is_leaf=is_experts) if is_experts(x)]
    idle = cfg.moe.n_experts - cfg.moe.experts_per_token
    return total - sum(_count(e) for e in experts) * idle // cfg.moe.n_experts


def human_count(n: int) -> str:
    """1234567 -> '1.23M'; 999885952 -> '1B' (rounded to 3 digits before the unit is chosen);
    Kimi K2's 1026408232448 -> '1.03T'."""
    rounded = float(f"{n:.3g}")
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if rounded >= size:
            return f"{rounded / size:.3g}{unit}"
    return str(n)
