"""ModelConfig: the frozen, flat description of one decoder-only Transformer.

Every architectural difference between the zoo's families (GPT-2, Llama 1/2/3, Mistral, Qwen2,
Qwen3, Gemma 1/2/3, Phi-3, OLMo 2, and the mixtures of experts Mixtral, Qwen2-MoE, OLMoE) is one
of the fields below; the model code reads nothing else. Validation is pydantic's, with its
errors rewritten into one-line `ConfigError`s that name the field, the value and the rule
(`ModelConfig.d_model=-1 must be positive`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pydantic
from pydantic import ConfigDict, Field, ValidationError

from eqllm.errors import EqllmError, rule, show

# A family is a name the families registry knows; config.py does not list them.
Family = str
NormKind = Literal["rmsnorm", "layernorm"]
MLPKind = Literal["gelu", "swiglu", "geglu"]
PositionKind = Literal["learned", "rope"]
RopeScaling = Literal["none", "llama3"]
# The one list of remat policies: eqllm.model maps each non-"none" name to a jax policy and the
# recipe's train.remat reuses this type.
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
DType = Literal["float32", "bfloat16", "float16"]
AttentionKind = Literal["auto", "xla", "cudnn"]
MoEImpl = Literal["dense", "ragged"]
# How initialisation, learning rates and a few forward multipliers follow width and depth
# (eqllm.parametrization): standard, muP (Tensor Programs V) or CompleteP (Dey et al. 2025).
Parametrization = Literal["sp", "mup", "completep"]

Positive = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


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
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise error(e, cls) from None

        cls.__init__ = __init__
        return cls

    return wrap


def _config_error(error: ValidationError, cls: type) -> ConfigError:
    first = error.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, EqllmError):  # raised by __post_init__ with its own message
        return ConfigError(str(cause))
    name = str(first["loc"][0]) if first["loc"] else ""
    if first["type"] == "missing":
        missing = [str(e["loc"][0]) for e in error.errors() if e["type"] == "missing"]
        return ConfigError(f"ModelConfig is missing required field(s) {', '.join(missing)}")
    if first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return _unknown(name)
    info = cls.__pydantic_fields__.get(name)
    return ConfigError(f"ModelConfig.{name}={show(first['input'])} {rule(first, info)}")


# strict: no "3" -> 3 or 64.0 -> 64; an int is still accepted where a float is expected.
@typing.no_type_check  # pydantic checks the fields (the test suite's beartype hook need not)
@validated(ConfigDict(strict=True, extra="forbid", allow_inf_nan=False), _config_error)
class ModelConfig:
    """Hyperparameters of a decoder-only Transformer (frozen, hashable, compared by value).

    Sizes: `vocab_size`, `d_model`, `n_layers`, `n_heads`, `n_kv_heads` (== n_heads: multi-head;
    1: multi-query; otherwise grouped-query; None at construction means n_heads), `d_ff` (hidden
    units of the MLP), `max_seq_len` (context length), `head_dim` (None at construction means
    d_model // n_heads; filled in, so never None afterwards).

    Parametrization (`eqllm.parametrization`, docs/scaling-laws.md): `parametrization` "sp",
    "mup" or "completep"; `base_d_model` and `base_n_layers` (None: this model's own) are the
    width and depth at which muP / CompleteP equal SP exactly; `output_mult` multiplies the
    muP readout.

    Architecture switches: `family` (a name of the families registry), `norm` (+ `norm_eps`,
    `norm_plus_one` for Gemma's (1 + w) scale), `mlp`, `position` (+ `rope_theta` and the Llama 3
    `rope_scaling`), biases, `tie_embeddings`, `sliding_window` (None: full causal attention),
    `qk_norm`, `embed_scale` (multiply token embeddings by sqrt(d_model), as Gemma does).

    Switches several recent families share: `pre_norms` / `post_norms` (a norm before each
    sublayer, and one on each sublayer's output before the residual add: Gemma 2/3 have both,
    OLMo 2 only the latter), `attn_softcap` / `final_softcap` (cap * tanh(x / cap) on the
    attention scores and on the final logits, Gemma 2), `global_every` (with a sliding window:
    every global_every-th layer attends to the whole context, the others to the window; None:
    every layer uses the window), `rope_local_theta` (the RoPE base of those windowed layers,
    Gemma 3), `query_pre_attn_scalar` (scores scaled by its inverse square root instead of
    head_dim's), `qk_norm_per_head` (False: QK-norm over the whole q and k projections, OLMo 2),
    `rope_fraction` (the leading fraction of each head that is rotated, Phi-3's
    partial_rotary_factor).

    Mixture of experts (`n_experts` None: a dense MLP in every layer): `n_experts` routed
    experts of hidden size `moe_d_ff` (None: d_ff) replace every block's MLP, `experts_per_token`
    of them per token, their top-k router probabilities renormalised when `norm_topk_prob`;
    `shared_expert_d_ff` adds Qwen-MoE's gated shared expert; `router_aux_loss_coef` weighs
    the load-balancing loss in training; `moe_impl` picks how the experts are computed ("dense":
    every expert on every token, fastest on CPU; "ragged": grouped matmul), same values.

    Numerics and compilation: `param_dtype`, `compute_dtype` (activations and matmuls; norms,
    softmax and the loss stay fp32), `scan_layers` (False unrolls the layer loop: faster steps
    on shallow models, compile time growing with depth), `remat` (jax.checkpoint policy for each
    block; a remat policy always runs the layers with lax.scan, because unrolled XLA schedules
    the recomputation early and the memory saving disappears), `init_std`, `attention` (the
    attention kernel: "xla" computes it in the model, "cudnn" uses cuDNN's fused kernel, "auto"
    the fused kernel where it can run, on a GPU with bf16/fp16 compute; see
    `eqllm.attention_backend`).
    """

    vocab_size: Positive
    d_model: Positive
    n_layers: Positive
    n_heads: Positive
    d_ff: Positive
    max_seq_len: Positive
    n_kv_heads: Positive | None = None
    head_dim: Positive | None = None
    parametrization: Parametrization = "sp"
    base_d_model: Positive | None = None
    base_n_layers: Positive | None = None
    output_mult: PositiveFloat = 1.0
    family: Annotated[Family, Field(min_length=1)] = "llama"
    norm: NormKind = "rmsnorm"
    norm_eps: PositiveFloat = 1e-5
    norm_plus_one: bool = False
    mlp: MLPKind = "swiglu"
    position: PositionKind = "rope"
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: Positive = 8192
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: Positive | None = None
    qk_norm: bool = False
    qk_norm_per_head: bool = True
    embed_scale: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    attn_softcap: PositiveFloat | None = None
    final_softcap: PositiveFloat | None = None
    global_every: Positive | None = None
    rope_local_theta: PositiveFloat | None = None
    query_pre_attn_scalar: Positive | None = None
    rope_fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    n_experts: Positive | None = None
    experts_per_token: Positive = 2
    moe_d_ff: Positive | None = None
    norm_topk_prob: bool = True
    shared_expert_d_ff: Positive | None = None
    router_aux_loss_coef: Annotated[float, Field(ge=0)] = 0.0
    moe_impl: MoEImpl = "dense"
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    scan_layers: bool = True
    remat: RematPolicy = "none"
    init_std: PositiveFloat = 0.02
    attention: AttentionKind = "auto"

    def __post_init__(self) -> None:
        # Runs after pydantic's field checks. Derived sizes are filled in once, here.
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            _require(
                self.d_model % self.n_heads == 0,
                "n_heads",
                self.n_heads,
                f"must divide d_model={self.d_model} (or set head_dim explicitly)",
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _require(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            self.n_kv_heads,
            f"must divide n_heads={self.n_heads}",
        )
        if self.position == "rope":
            even = self.rotary_dim % 2 == 0 and self.rotary_dim > 0
            if self.rope_fraction == 1:
                _require(even, "head_dim", self.head_dim, "must be even with rotary positions")
            _require(
                even,
                "rope_fraction",
                self.rope_fraction,
                f"must rotate an even, non-zero number of dims (head_dim={self.head_dim})",
            )
        _require(
            self.rope_fraction == 1 or self.position == "rope",
            "rope_fraction",
            self.rope_fraction,
            "needs position='rope'",
        )
        _require(
            self.qk_norm_per_head or self.qk_norm,
            "qk_norm_per_head",
            self.qk_norm_per_head,
            "only matters with qk_norm=True",
        )
        _require(
            self.global_every is None or self.sliding_window is not None,
            "global_every",
            self.global_every,
            "needs a sliding_window for the other layers",
        )
        _require(
            self.rope_local_theta is None
            or (self.global_every is not None and self.position == "rope"),
            "rope_local_theta",
            self.rope_local_theta,
            "needs position='rope' and global_every (it is the base of the windowed layers)",
        )
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

        if self.n_experts is not None:
            _require(
                self.experts_per_token <= self.n_experts,
                "experts_per_token",
                self.experts_per_token,
                f"must be <= n_experts={self.n_experts}",
            )
            _require(self.mlp == "swiglu", "mlp", self.mlp, "must be 'swiglu' with n_experts")
        _require(
            self.parametrization == "sp" or self.n_experts is None,
            "parametrization",
            self.parametrization,
            "is only defined for dense models here (a router's width scaling is not); use 'sp' "
            "with n_experts",
        )
        _require(
            self.shared_expert_d_ff is None or self.n_experts is not None,
            "shared_expert_d_ff",
            self.shared_expert_d_ff,
            "needs n_experts (it is the always-on expert beside the routed ones)",
        )

    @property
    def expert_d_ff(self) -> int:
        """The hidden size of each routed expert."""
        return self.moe_d_ff or self.d_ff

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates (the leading ones; the rest pass through)."""
        return int(self.head_dim * self.rope_fraction)

    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the sliding window (True) or to everything?"""
        if self.sliding_window is None:
            return (False,) * self.n_layers
        every = self.global_every
        return tuple(every is None or (i + 1) % every != 0 for i in range(self.n_layers))

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with some fields changed (validated); unknown fields name the valid ones.

        Sizes that equal their default count as derived and follow the fields they derive from
        unless `overrides` sets them too: head_dim == d_model // n_heads follows d_model and
        n_heads, n_kv_heads == n_heads (multi-head attention) follows n_heads.
        """
        _check_names(overrides)
        values = {name: getattr(self, name) for name in ModelConfig.__pydantic_fields__}
        changed = set(overrides)
        if self.head_dim == self.d_model // self.n_heads and changed & {"d_model", "n_heads"}:
            values["head_dim"] = None
        if self.n_kv_heads == self.n_heads and "n_heads" in changed:
            values["n_kv_heads"] = None
        return ModelConfig(**{**values, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        _check_names(values)
        fields = cls.__pydantic_fields__
        missing = [n for n, f in fields.items() if f.is_required() and n not in values]
        if missing:
            raise ConfigError(f"ModelConfig is missing required field(s) {', '.join(missing)}")
        return cls(**values)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 * matmul parameters + 12 * L * H * Q * T for attention.

        With experts, the matmul parameters are the active ones: the router, the
        `experts_per_token` experts a token reaches and the shared expert. Matmul parameters
        exclude the embedding table unless it is tied into the LM head (then
        it is counted once, as the head). Attention uses the PaLM convention (appendix B) without
        halving for the causal mask; T is `seq_len` (default: max_seq_len), capped by the
        sliding window in the layers that have it.
        """
        full = seq_len or self.max_seq_len
        local = self.local_layers()
        t = sum(min(full, self.sliding_window) if w else full for w in local) / self.n_layers
        d, h, kv, q = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * q * (h + 2 * kv) + h * q * d
        mlp = (3 if self.mlp in ("swiglu", "geglu") else 2) * d * self.d_ff
        if self.n_experts is not None:
            shared = 3 * d * self.shared_expert_d_ff + d if self.shared_expert_d_ff else 0
            mlp = d * self.n_experts + 3 * d * self.expert_d_ff * self.experts_per_token + shared
        head = d * self.vocab_size
        matmul_params = self.n_layers * (attn + mlp) + head
        return 6.0 * matmul_params + 12.0 * self.n_layers * h * q * t


def field_names() -> list[str]:
    return list(ModelConfig.__pydantic_fields__)


def _require(ok: bool, name: str, value: Any, broken: str) -> None:
    if not ok:
        raise ConfigError(f"ModelConfig.{name}={show(value)} {broken}")


def _check_names(values: dict[str, Any]) -> None:
    for key in values:
        if key not in ModelConfig.__pydantic_fields__:
            raise _unknown(key)


def _unknown(key: Any) -> ConfigError:
    names = field_names()
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown ModelConfig field {key!r}; {hint}valid fields: {', '.join(names)}")
