"""ModelConfig's position groups: RoPE (with its scaling past the trained context) or a
learned table (see `eqllm.config.groups` for how the groups are built and validated)."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from eqllm.config.validation import (
    STRICT,
    Positive,
    PositiveFloat,
    config_error,
    require,
    validated,
)

PositionKind = Literal["learned", "rope", "none"]
RopeScalingKind = Literal["linear", "llama3", "yarn", "longrope", "dynamic"]

_group = validated(STRICT, config_error)


# The settings each RoPE scaling kind reads (`kind` aside); every other one must stay unset.
SCALING_FIELDS = {
    "linear": {"factor"},
    "llama3": {"factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"},
    "yarn": {
        "factor",
        "original_max_seq_len",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
    "longrope": {
        "factor",
        "original_max_seq_len",
        "attention_factor",
        "short_factor",
        "long_factor",
    },
    "dynamic": {"factor", "original_max_seq_len"},
}
# Settings a kind needs (longrope's factor defaults to max_seq_len / original_max_seq_len).
SCALING_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_seq_len"),
    "longrope": ("original_max_seq_len", "short_factor", "long_factor"),
    "dynamic": ("factor", "original_max_seq_len"),
}


@typing.no_type_check
@_group
class RopeScalingConfig:
    """How RoPE's frequencies are stretched beyond the trained context (`eqllm.nn.RopeScaling`
    computes them as transformers does).

    `kind`: "linear" (positions divided by `factor`), "llama3" (long wavelengths divided by
    `factor`, short ones kept, `low_freq_factor` / `high_freq_factor` bound the band between),
    "yarn" (`beta_fast` / `beta_slow` bound the ramp, `mscale` / `mscale_all_dim` or
    `attention_factor` the attention factor, `truncate` rounds the band), "longrope"
    (`short_factor` within the original context, `long_factor` past it, per frequency; `factor`
    None means max_seq_len / original_max_seq_len) or "dynamic" (NTK-aware: the base grows once
    a sequence passes `original_max_seq_len`). Each kind reads only its own settings; the others
    stay None.
    """

    PATH: ClassVar[str] = "ModelConfig.positions.scaling"

    kind: RopeScalingKind
    factor: PositiveFloat | None = None
    original_max_seq_len: Positive | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: PositiveFloat | None = None
    truncate: bool | None = None
    short_factor: tuple[PositiveFloat, ...] | None = None
    long_factor: tuple[PositiveFloat, ...] | None = None

    @staticmethod
    def _prepare(values: dict[str, Any]) -> dict[str, Any]:
        # TOML and JSON give lists; the config keeps tuples (hashable).
        return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}

    def __post_init__(self) -> None:
        used = SCALING_FIELDS[self.kind]
        for name in self.__pydantic_fields__:
            value = getattr(self, name)
            if name != "kind" and name not in used:
                require(
                    value is None,
                    f"{self.PATH}.{name}",
                    value,
                    f"is not used by kind={self.kind!r}",
                )
        for name in SCALING_REQUIRED[self.kind]:
            require(
                getattr(self, name) is not None,
                f"{self.PATH}.{name}",
                None,
                f"must be set for kind={self.kind!r}",
            )
        if self.kind in ("llama3", "dynamic"):
            require(self.factor >= 1, f"{self.PATH}.factor", self.factor, "must be >= 1")
        if self.kind == "llama3":
            require(
                self.high_freq_factor > self.low_freq_factor,
                f"{self.PATH}.high_freq_factor",
                self.high_freq_factor,
                f"must exceed low_freq_factor={self.low_freq_factor}",
            )
        if self.kind == "longrope":
            require(
                len(self.short_factor) == len(self.long_factor),
                f"{self.PATH}.long_factor",
                list(self.long_factor),
                f"must have as many entries as short_factor ({len(self.short_factor)})",
            )


@typing.no_type_check
@_group
class PositionsConfig:
    """Where position information comes from: rotary embeddings or a learned table.

    `kind` "rope" (Su et al., 2021) with base `theta`, `local_theta` for the windowed layers
    (Gemma 3; None: theta everywhere), `fraction` (the leading fraction of each head that is
    rotated, Phi-3's partial_rotary_factor), `scaling` (None: plain RoPE) and `nope_every`
    (every nope_every-th layer, counting from 1, rotates nothing: a "NoPE" layer whose attention
    sees no positions, SmolLM3; None: every layer rotates); "learned": a trained table of
    max_seq_len positions (GPT-2), which uses none of the RoPE settings; "none": no position
    information but the causal mask and the recurrent layers' order (OLMo hybrid's release).
    `global_fraction` (None: all): proportional RoPE on the global layers of a stack of their
    own (`attention.global_shape`, Gemma 4): only the first global_fraction of each head's
    frequencies turn, with exponents over the whole head; the others stay at angle 0.
    """

    PATH: ClassVar[str] = "ModelConfig.positions"

    kind: PositionKind = "rope"
    theta: PositiveFloat = 10000.0
    local_theta: PositiveFloat | None = None
    fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    scaling: RopeScalingConfig | None = None
    nope_every: Positive | None = None
    global_fraction: Annotated[float, Field(gt=0, le=1)] | None = None

    @staticmethod
    def _prepare(values: dict[str, Any]) -> dict[str, Any]:
        if isinstance(values.get("scaling"), dict):
            values = {**values, "scaling": RopeScalingConfig(**values["scaling"])}
        return values

    def __post_init__(self) -> None:
        if self.kind == "rope":
            return
        rope_only = {
            "local_theta": None,
            "fraction": 1.0,
            "scaling": None,
            "nope_every": None,
            "global_fraction": None,
        }
        for name, plain in rope_only.items():
            value = getattr(self, name)
            require(value == plain, f"{self.PATH}.{name}", value, "needs kind='rope'")
