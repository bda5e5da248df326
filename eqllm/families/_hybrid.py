"""config.json's `layer_types` of a Gated DeltaNet hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
OLMo hybrid) <-> `ModelConfig.linear`'s layer settings.

transformers runs any order of "linear_attention" and "full_attention" layers; so does eqllm's
stack (`eqllm.config.kinds.segments`: a repeated group with the attention layer anywhere, a cut
last group, an irregular stretch as runs). The published files are groups of linear layers each
closed by one attention layer, read as `full_every`; any other order is read as `pattern`, the
shortest group that, repeated and cut at the depth, gives every layer (an irregular order is
its own whole list). Export writes `layer_types` from the layers' kinds, so it comes back as it
was read.
"""

from __future__ import annotations

from typing import Any

from eqllm.config import ConfigError, ModelConfig

_KINDS = {"linear_attention": "linear", "full_attention": "full"}


def to_layer_types(cfg: ModelConfig) -> list[str]:
    """config.json's `layer_types`: each layer's kind, "linear_attention" or "full_attention"."""
    return [f"{kind}_attention" for kind in cfg.layer_kinds()]


def from_layer_types(
    types: list[str], n_layers: int, family: str, *, needs_linear: bool = False
) -> dict[str, Any]:
    """`ModelConfig.linear`'s `full_every` and `pattern` for config.json's `layer_types` (one
    entry per layer of `n_layers`); refused by name where eqllm's `family` cannot run it, or,
    with `needs_linear`, where it has no linear_attention layer (transformers' OLMo hybrid
    refuses that)."""
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise ConfigError(
            f"config.json layer_types has {unknown}: eqllm's {family} reads only "
            f"{sorted(_KINDS)} layers"
        )
    if len(types) != n_layers:
        raise ConfigError(
            f"config.json layer_types has {len(types)} entries for num_hidden_layers={n_layers}: "
            "give one per layer"
        )
    kinds = tuple(_KINDS[t] for t in types)
    if "full" not in kinds:
        # A stack of linear layers alone is held as `blocks`, where the key table puts the
        # attention layers: eqllm's Gated DeltaNet families have at least one.
        raise ConfigError(
            f"config.json layer_types={types} has no full_attention layer: eqllm's {family} "
            "needs at least one (a stack of linear layers alone is eqllm's mamba2)"
        )
    if needs_linear and "linear" not in kinds:
        raise ConfigError(
            f"config.json layer_types={types} has no linear_attention layer: {family} needs at "
            "least one (transformers refuses it too)"
        )
    every = kinds.index("full") + 1
    if every >= 2 and kinds == _every(every, n_layers):
        return {"full_every": every, "pattern": None}
    period = next(p for p in range(1, n_layers + 1) if kinds == _cycle(kinds[:p], n_layers))
    return {"full_every": None, "pattern": kinds[:period]}


def _every(every: int, n_layers: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % every == 0 else "linear" for i in range(n_layers))


def _cycle(group: tuple[str, ...], n_layers: int) -> tuple[str, ...]:
    return tuple(group[i % len(group)] for i in range(n_layers))
