"""The forward-multiplier group of ModelConfig (`ModelConfig.multipliers`): constants a published
model multiplies its activations by, fixed at training time (Falcon-H1's muP multipliers)."""

from __future__ import annotations

import typing
from typing import Any, ClassVar

from eqllm.config.validation import STRICT, config_error, require, validated

_group = validated(STRICT, config_error)


@typing.no_type_check
@_group
class MultipliersConfig:
    """Constant factors on activations, each 1.0 where a model has none (None: all 1.0).

    `embedding`: the token embeddings; `logits`: the LM head's output (before any soft-cap);
    `attention_in` / `attention_out`: attention's input (after the block's norm) and output;
    `key`: the keys (applied as a factor on the softmax scale, the same scores); `ssm_in` /
    `ssm_out`: a Mamba-2 mixer's input and output; `ssm`: its five input projections' outputs,
    in the order z, x, B, C, dt (Falcon-H1's `mup_vector`); `mlp_gate` / `mlp_down`: a gated
    MLP's gate projection (before its activation) and its down projection's output;
    `residual`: each sublayer's output before its residual add (Granite's residual_multiplier);
    `logits_divisor`: the LM head's output divided by it (Granite's logits_scaling, divided as
    transformers divides); `attention_scale`: the softmax scale in place of 1 / sqrt(head_dim)
    (Granite's attention_multiplier; None: 1 / sqrt(head_dim)).

    They are applied in the forward pass, not folded into weights, so a checkpoint imports and
    exports bit for bit and training sees the same parametrization the model was trained in.
    """

    PATH: ClassVar[str] = "ModelConfig.multipliers"

    embedding: float = 1.0
    logits: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    residual: float = 1.0
    logits_divisor: float = 1.0
    attention_scale: float | None = None

    @staticmethod
    def _prepare(values: dict[str, Any]) -> dict[str, Any]:
        # TOML and JSON give lists and integers; the config keeps tuples of floats (hashable).
        def plain(v):
            if isinstance(v, list | tuple):
                return tuple(float(x) if isinstance(x, int) else x for x in v)
            return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

        return {k: plain(v) for k, v in values.items()}

    def __post_init__(self) -> None:
        require(
            self.logits_divisor > 0,
            f"{self.PATH}.logits_divisor",
            self.logits_divisor,
            "must be > 0 (1.0: logits as the head gives them)",
        )
        require(
            self.attention_scale is None or self.attention_scale > 0,
            f"{self.PATH}.attention_scale",
            self.attention_scale,
            "must be > 0, or unset for 1 / sqrt(head_dim)",
        )
        require(
            len(self.ssm) == 5,
            f"{self.PATH}.ssm",
            list(self.ssm),
            "must be five numbers, the factors of z, x, B, C and dt",
        )
