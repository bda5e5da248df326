"""The linear-attention group of ModelConfig (`ModelConfig.linear`): hybrid stacks that mix
Gated DeltaNet (`eqllm.nn.GatedDeltaNet`) or Mamba-2 (`eqllm.nn.Mamba2`) layers with softmax
attention layers, and stacks of Mamba-2 layers alone."""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Literal

from eqllm.config.validation import (
    STRICT,
    Positive,
    PositiveFloat,
    config_error,
    require,
    validated,
)

LinearKind = Literal["gated_deltanet", "mamba2"]
# Where a Mamba-2 mixer's gated RMSNorm sits: norm(y * silu(z)) (Mamba-2's), norm(y) * silu(z),
# or no norm at all, y * silu(z) (Falcon-H1's mamba_rms_norm false).
GateNorm = Literal["after_gate", "before_gate", "none"]

_group = validated(STRICT, config_error)


@typing.no_type_check
@_group
class LinearAttentionConfig:
    """Linear-attention layers (`kind`) in place of attention in all but every
    `full_every`-th layer, or in every layer (`full_every` unset, Mamba-2 only), or as
    `pattern` says: "linear" and "full" layers in any order, repeated from the first layer and
    cut at n_layers (Nemotron-H's and Granite-4.0-H's attention layers sit mid-group; a
    pattern as long as the model is its per-layer list, any config.json `layer_types`), and
    "ffn" layers: a feed-forward layer alone, no token mixer (the MLP, or the experts with
    `moe`: Nemotron-H's "-" and "E" layers).

    The layers repeat in groups of `full_every`: `full_every - 1` linear-attention layers, then
    one softmax attention layer (Qwen3.5 and Qwen3-Next: `full_attention_interval` = 4). Their
    sizes: `n_key_heads` query/key heads of `key_head_dim`, `n_value_heads` value heads of
    `value_head_dim` (a multiple of the key heads), a causal convolution `conv_kernel` wide over
    q, k and v; `chunk_size` tokens per chunk of the chunked form (how it runs, not what it
    computes). The gated output norm uses `norm_eps` (None: `norms.eps`; OLMo hybrid fixes
    1e-5 whatever its rms_norm_eps). `allow_neg_eigval`: the write strength is 2 * sigmoid(b),
    in (0, 2), so the state's transition may have negative eigenvalues (OLMo hybrid).
    `pre_norm`: these layers normalise their inputs (pre-norm, no output norms) whatever
    `norms.pre` and `norms.post` say for the attention layers (OLMo hybrid: post-norm
    attention layers, pre-norm Gated DeltaNet layers); False: every layer as `norms` says.

    Mamba-2 (`kind = "mamba2"`) reads the same sizes the way state-space duality pairs them:
    B and C are keys and queries shared by groups of heads (`n_key_heads` = n_groups,
    `key_head_dim` = state_size), x the values (`n_value_heads` = num_heads, `value_head_dim`
    = head_dim); dt is clamped to [`dt_min`, `dt_max`] (transformers' time_step_limit; None: no
    upper limit). `mlp` False leaves the MLP out of the linear layers (Mamba-2's blocks are
    norm -> mixer -> residual); a stack without attention layers then uses neither the
    `attention` nor the `mlp` group. `gate_norm`: where Mamba-2's gated RMSNorm sits (see
    `GateNorm`).

    `full_mlp` False leaves the MLP out of the attention layers too (Nemotron-H: every layer is
    one sublayer, its feed-forward layers are "ffn" layers of their own).

    `parallel`: every layer is an attention layer with this mixer beside it, both reading the
    block's normed input, their outputs summed before the residual add, then the MLP
    (Falcon-H1); `full_every` stays unset and the layers are one stack, `blocks`.
    """

    PATH: ClassVar[str] = "ModelConfig.linear"

    n_key_heads: Positive
    n_value_heads: Positive
    key_head_dim: Positive
    value_head_dim: Positive
    full_every: Positive | None = None
    pattern: tuple[Literal["linear", "full", "ffn"], ...] | None = None
    conv_kernel: Positive = 4
    chunk_size: Positive = 64
    kind: LinearKind = "gated_deltanet"
    norm_eps: PositiveFloat | None = None
    allow_neg_eigval: bool = False
    pre_norm: bool = False
    mlp: bool = True
    dt_min: float = 0.0
    dt_max: PositiveFloat | None = None
    gate_norm: GateNorm = "after_gate"
    parallel: bool = False
    full_mlp: bool = True

    @staticmethod
    def _prepare(values: dict[str, Any]) -> dict[str, Any]:
        # TOML and JSON give the pattern as a list; the config keeps a tuple (hashable).
        if isinstance(values.get("pattern"), list):
            values = {**values, "pattern": tuple(values["pattern"])}
        return values

    @staticmethod
    def _prepare(values: dict) -> dict:
        # TOML and JSON give a list; the config keeps a tuple (hashable).
        if isinstance(values.get("pattern"), list):
            values = {**values, "pattern": tuple(values["pattern"])}
        return values

    def __post_init__(self) -> None:
        require(
            self.n_value_heads % self.n_key_heads == 0,
            f"{self.PATH}.n_key_heads",
            self.n_key_heads,
            f"must divide n_value_heads={self.n_value_heads}",
        )
        require(
            self.full_every is None or not self.parallel,
            f"{self.PATH}.full_every",
            self.full_every,
            "must be unset with parallel (every layer has attention and the mixer)",
        )
        require(
            self.gate_norm == "after_gate" or self.kind == "mamba2",
            f"{self.PATH}.gate_norm",
            self.gate_norm,
            f"is Mamba-2's; leave it at 'after_gate' for kind={self.kind!r}",
        )
        require(
            self.pattern is None
            or (self.full_every is None and not self.parallel and len(self.pattern) > 0),
            f"{self.PATH}.pattern",
            self.pattern,
            "must be a non-empty list of 'linear', 'full' and 'ffn', with full_every and parallel "
            "unset",
        )
        require(
            self.full_every is not None
            or self.pattern is not None
            or self.kind == "mamba2"
            or self.parallel,
            f"{self.PATH}.full_every",
            None,
            f"must be set for kind={self.kind!r} (a stack of linear layers alone is Mamba-2's)",
        )
        require(
            self.full_every is None or self.full_every >= 2,
            f"{self.PATH}.full_every",
            self.full_every,
            "must be at least 2 (one linear-attention layer before each full one), or unset "
            "for a stack without attention (kind mamba2)",
        )
        for name, plain in (("dt_min", 0.0), ("dt_max", None)):
            value = getattr(self, name)
            require(
                self.kind == "mamba2" or value == plain,
                f"{self.PATH}.{name}",
                value,
                f"is Mamba-2's time-step limit; leave it at {plain} for kind={self.kind!r}",
            )
        require(self.dt_min >= 0, f"{self.PATH}.dt_min", self.dt_min, "must be >= 0")
        require(
            self.dt_max is None or self.dt_max > self.dt_min,
            f"{self.PATH}.dt_max",
            self.dt_max,
            f"must be greater than dt_min={self.dt_min}",
        )

    def kinds(self, n_layers: int) -> tuple[str, ...]:
        """Per layer: "linear", "full" or "ffn" (`pattern` repeated, or every full_every-th layer,
        counting from 1; none when both are unset; every layer when `parallel`, the mixer
        inside the block)."""
        if self.parallel:
            return ("full",) * n_layers
        if self.pattern is not None:
            return tuple(self.pattern[i % len(self.pattern)] for i in range(n_layers))
        every = self.full_every
        return tuple(
            "full" if every and (i + 1) % every == 0 else "linear" for i in range(n_layers)
        )

    @property
    def pure(self) -> bool:
        """Whether every layer is a linear layer (no attention layers)."""
        return self.full_every is None and not self.parallel and "full" not in (self.pattern or ())


def check_hybrid(cfg) -> None:
    """Raise unless a ModelConfig with `linear` is a stack of the two kinds the hybrid has:
    attention and linear layers, none with the dense MLP of a mixture of experts (a fourth
    stack), no latent attention."""
    for path, plain in (
        ("attention.kind", "gqa"),
        ("moe.dense_layers", None if cfg.moe is None else 0),
        ("moe.sparse_every", None if cfg.moe is None else 1),
    ):
        value = cfg.at(path)
        require(value == plain, f"ModelConfig.{path}", value, f"must be {plain} in a hybrid stack")
