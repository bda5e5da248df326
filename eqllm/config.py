"""ModelConfig: the frozen, flat description of one decoder-only Transformer.

Every architectural difference between the zoo's families (GPT-2, Llama 1/2/3, Mistral, Qwen2,
Gemma) is one of the fields below; the model code reads nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, get_args

from eqllm.errors import EqllmError

Family = Literal["gpt2", "llama", "mistral", "qwen2", "gemma"]
NormKind = Literal["rmsnorm", "layernorm"]
MLPKind = Literal["gelu", "swiglu", "geglu"]
PositionKind = Literal["learned", "rope"]
RopeScaling = Literal["none", "llama3"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(EqllmError):
    """An invalid configuration value; the message names the field, the value and the rule."""


@typing.no_type_check  # validates itself in __post_init__, with messages that say more
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only Transformer.

    Sizes: `vocab_size`, `d_model`, `n_layers`, `n_heads`, `n_kv_heads` (== n_heads: multi-head;
    1: multi-query; otherwise grouped-query), `d_ff` (hidden units of the MLP), `max_seq_len`
    (context length), `head_dim` (None: d_model // n_heads).

    Architecture switches: `norm` (+ `norm_eps`, `norm_plus_one` for Gemma's (1 + w) scale),
    `mlp`, `position` (+ `rope_theta` and the Llama 3 `rope_scaling`), biases, `tie_embeddings`,
    `sliding_window` (None: full causal attention), `qk_norm`, `embed_scale` (multiply token
    embeddings by sqrt(d_model), as Gemma does).

    Numerics and compilation: `param_dtype`, `compute_dtype` (activations and matmuls; norms,
    softmax and the loss stay fp32), `scan_layers` (False unrolls the layer loop: faster steps
    on shallow models, compile time growing with depth), `remat` (jax.checkpoint policy for each
    block; a remat policy always runs the layers with lax.scan, because unrolled XLA schedules
    the recomputation early and the memory saving disappears), `init_std`.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    family: Family = "llama"
    norm: NormKind = "rmsnorm"
    norm_eps: float = 1e-5
    norm_plus_one: bool = False
    mlp: MLPKind = "swiglu"
    position: PositionKind = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    embed_scale: bool = False
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    scan_layers: bool = True
    remat: RematPolicy = "none"
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), field.type)
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_seq_len",
        ):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, value, "must be positive or None")
        if self.head_dim is None:
            _require(
                self.d_model % self.n_heads == 0,
                "n_heads",
                self.n_heads,
                f"must divide d_model={self.d_model} (or set head_dim explicitly)",
            )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            self.n_kv_heads,
            f"must divide n_heads={self.n_heads}",
        )
        if self.position == "rope":
            _require(
                self.dim_per_head % 2 == 0,
                "head_dim",
                self.dim_per_head,
                "must be even with rotary positions",
            )
            _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be positive")
        if self.rope_scaling == "llama3":
            _require(
                self.position == "rope", "rope_scaling", self.rope_scaling, "needs position='rope'"
            )
            _require(self.rope_factor >= 1, "rope_factor", self.rope_factor, "must be >= 1")
            _require(
                self.rope_high_freq_factor > self.rope_low_freq_factor,
                "rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"must exceed rope_low_freq_factor={self.rope_low_freq_factor}",
            )
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "must be positive")
        _require(self.init_std > 0, "init_std", self.init_std, "must be positive")
        _require(
            not (self.norm_bias and self.norm == "rmsnorm"),
            "norm_bias",
            self.norm_bias,
            "is only defined for norm='layernorm'",
        )
        _require(
            not (self.norm_plus_one and self.norm == "layernorm"),
            "norm_plus_one",
            self.norm_plus_one,
            "is only defined for norm='rmsnorm'",
        )

    @property
    def dim_per_head(self) -> int:
        """Size of one attention head (head_dim if set, else d_model // n_heads)."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with some fields changed; unknown fields are an error naming the valid ones."""
        unknown = sorted(set(overrides) - set(field_names()))
        if unknown:
            raise ConfigError(
                f"unknown ModelConfig field(s) {unknown}; valid fields: {', '.join(field_names())}"
            )
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        unknown = sorted(set(values) - set(field_names()))
        if unknown:
            raise ConfigError(
                f"unknown ModelConfig field(s) {unknown}; valid fields: {', '.join(field_names())}"
            )
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in values
        ]
        if missing:
            raise ConfigError(f"ModelConfig is missing required field(s) {missing}")
        return cls(**values)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 * matmul parameters + 12 * L * H * Q * T for attention.

        Matmul parameters exclude the embedding table unless it is tied into the LM head (then
        it is counted once, as the head). Attention uses the PaLM convention (appendix B) without
        halving for the causal mask; T is `seq_len` (default: max_seq_len), capped by the
        sliding window.
        """
        t = seq_len or self.max_seq_len
        if self.sliding_window is not None:
            t = min(t, self.sliding_window)
        d, h, kv, q = self.d_model, self.n_heads, self.n_kv_heads, self.dim_per_head
        attn = d * q * (h + 2 * kv) + h * q * d
        mlp = (3 if self.mlp in ("swiglu", "geglu") else 2) * d * self.d_ff
        head = d * self.vocab_size
        matmul_params = self.n_layers * (attn + mlp) + head
        return 6.0 * matmul_params + 12.0 * self.n_layers * h * q * t


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"ModelConfig.{name}={value!r} {rule}")


_SCALARS = {"int": int, "float": (int, float), "bool": bool, "str": str}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """Check a field against its annotation (strings, since annotations are postponed)."""
    options = [a.strip() for a in annotation.split("|")]
    if value is None:
        _require("None" in options, name, value, "must not be None")
        return
    literal = globals().get(options[0])
    if literal is not None and get_args(literal):
        allowed = get_args(literal)
        _require(value in allowed, name, value, f"must be one of {list(allowed)}")
        return
    for option in options:
        kind = _SCALARS.get(option)
        if kind is None:
            continue
        if isinstance(value, bool) and option != "bool":
            continue
        if isinstance(value, kind):
            if option == "float" and not math.isfinite(value):
                continue
            return
    _require(False, name, value, f"must be of type {annotation}")
