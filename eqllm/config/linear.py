"""The linear-attention group of ModelConfig (`ModelConfig.linear`): hybrid stacks that mix
Gated DeltaNet layers (`eqllm.nn.GatedDeltaNet`) with softmax attention layers."""

from __future__ import annotations

import typing
from typing import ClassVar, Literal

from eqllm.config.validation import (
    STRICT,
    Positive,
    PositiveFloat,
    config_error,
    require,
    validated,
)

LinearKind = Literal["gated_deltanet"]

_group = validated(STRICT, config_error)


@typing.no_type_check
@_group
class LinearAttentionConfig:
    """Gated DeltaNet layers in place of attention in all but every `full_every`-th layer.

    The layers repeat in groups of `full_every`: `full_every - 1` linear-attention layers, then
    one softmax attention layer (Qwen3.5 and Qwen3-Next: `full_attention_interval` = 4). Their
    sizes: `n_key_heads` query/key heads of `key_head_dim`, `n_value_heads` value heads of
    `value_head_dim` (a multiple of the key heads), a causal convolution `conv_kernel` wide over
    q, k and v; `chunk_size` tokens per chunk of the chunked delta rule (how it runs, not what
    it computes). The gated output norm uses `norm_eps` (None: `norms.eps`; OLMo hybrid fixes
    1e-5 whatever its rms_norm_eps). `allow_neg_eigval`: the write strength is 2 * sigmoid(b),
    in (0, 2), so the state's transition may have negative eigenvalues (OLMo hybrid).
    `pre_norm`: these layers normalise their inputs (pre-norm, no output norms) whatever
    `norms.pre` and `norms.post` say for the attention layers (OLMo hybrid: post-norm
    attention layers, pre-norm Gated DeltaNet layers); False: every layer as `norms` says.
    """

    PATH: ClassVar[str] = "ModelConfig.linear"

    full_every: Positive
    n_key_heads: Positive
    n_value_heads: Positive
    key_head_dim: Positive
    value_head_dim: Positive
    conv_kernel: Positive = 4
    chunk_size: Positive = 64
    kind: LinearKind = "gated_deltanet"
    norm_eps: PositiveFloat | None = None
    allow_neg_eigval: bool = False
    pre_norm: bool = False

    def __post_init__(self) -> None:
        require(
            self.n_value_heads % self.n_key_heads == 0,
            f"{self.PATH}.n_key_heads",
            self.n_key_heads,
            f"must divide n_value_heads={self.n_value_heads}",
        )
        require(
            self.full_every >= 2,
            f"{self.PATH}.full_every",
            self.full_every,
            "must be at least 2 (one linear-attention layer before each full one)",
        )

    def kinds(self, n_layers: int) -> tuple[str, ...]:
        """Per layer: "linear" or "full" (every full_every-th layer, counting from 1)."""
        return tuple(
            "full" if (i + 1) % self.full_every == 0 else "linear" for i in range(n_layers)
        )


def check_hybrid(cfg) -> None:
    """Raise unless a ModelConfig with `linear` is a stack the groups scan can run: whole groups
    of layers, and none of the per-layer switches of the other stacks."""
    every = cfg.linear.full_every
    require(
        cfg.n_layers % every == 0,
        "ModelConfig.n_layers",
        cfg.n_layers,
        f"must be a multiple of linear.full_every={every} (the stack scans whole groups)",
    )
    for path, plain in (
        ("attention.global_every", None),
        ("positions.nope_every", None),
        ("attention.kind", "gqa"),
        ("moe.dense_layers", None if cfg.moe is None else 0),
    ):
        value = cfg.at(path)
        require(value == plain, f"ModelConfig.{path}", value, f"must be {plain} in a hybrid stack")
