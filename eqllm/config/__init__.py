"""ModelConfig: the frozen description of one decoder-only Transformer, in groups.

Sizes sit at the top (`vocab_size`, `d_model`, `n_layers`, `max_seq_len`); each mechanism is one
frozen, validated group (`eqllm.config.groups`): `attention`, `positions`, `mlp`, `moe` (None
for a dense model) and `norms`. Every architectural difference between the zoo's families
(GPT-2, GPT-NeoX/Pythia, Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 1/2/3, Phi-3, OLMo 2,
SmolLM3, and the mixtures of experts Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE and gpt-oss) is one
of these settings; the model code reads nothing else. Validation is pydantic's, with its errors
rewritten into one-line `ConfigError`s that name the full dotted path, the value and the rule
(`ModelConfig.attention.n_kv_heads=3 must divide n_heads=8`).

A setting is addressed by its dotted path (`"attention.n_kv_heads"`) in `ModelConfig.at`,
`replace(**{"attention.n_kv_heads": 2})`, zoo TOML files (`attention.n_heads = 8`), recipes'
`model.overrides` and `--set model.overrides.attention.n_kv_heads=2`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from eqllm.config import flops
from eqllm.config.groups import (
    GROUPS,
    SUBGROUPS,
    AttentionConfig,
    LinearAttentionConfig,
    MLPConfig,
    MoEConfig,
    MultipliersConfig,
    NormsConfig,
    PositionsConfig,
    RopeScalingConfig,
)
from eqllm.config.keys import dotted, expand, merge
from eqllm.config.kinds import layer_kinds
from eqllm.config.legacy import from_flat
from eqllm.config.linear import check_hybrid
from eqllm.config.per_layer import PerLayerConfig, check_sharing
from eqllm.config.validation import (
    STRICT,
    ConfigError,
    Positive,
    PositiveFloat,
    config_error,
    require,
    unknown_field,
    validated,
)
from eqllm.errors import rule, show

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "DType",
    "LinearAttentionConfig",
    "MLPConfig",
    "ModelConfig",
    "MoEConfig",
    "NormsConfig",
    "PositionsConfig",
    "RematPolicy",
    "RopeScalingConfig",
    "dotted",
    "expand",
    "field_names",
    "merge",
    "rule",
    "show",
    "validated",
]

# A family is a name the families registry knows; config.py does not list them.
Family = str
# The one list of remat policies: eqllm.stack.run maps each non-"none" name to a jax policy, the
# recipe's train.remat reuses this type and the commands offer its names. "offload" is "full"
# with each layer's input moved to host memory until the backward pass needs it.
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "offload"]
DType = Literal["float32", "bfloat16", "float16"]
# How initialisation, learning rates and a few forward multipliers follow width and depth
# (eqllm.parametrization): standard, muP (Tensor Programs V) or CompleteP (Dey et al. 2025).
Parametrization = Literal["sp", "mup", "completep"]


@typing.no_type_check  # pydantic checks the fields (the test suite's beartype hook need not)
@validated(STRICT, config_error)
class ModelConfig:
    """Hyperparameters of a decoder-only Transformer (frozen, hashable, compared by value).

    Sizes: `vocab_size`, `d_model`, `n_layers`, `max_seq_len` (context length).

    Groups (see `eqllm.config.groups`; a dict is accepted for each and validated there, and
    so are dotted keys, `ModelConfig(**{"attention.n_heads": 8, ...})`):
    `attention` (heads, kv heads, head size, biases, QK-norm, soft-cap, windows, scale, kernel),
    `positions` (RoPE with its base, fraction and scaling, or learned), `mlp` (kind, d_ff,
    bias), `moe` (None: a dense MLP in every block), `norms` (kind, eps, plus-one, bias,
    placement), `linear` (None: attention in every layer; else Gated DeltaNet or Mamba-2 layers
    between every `full_every`-th attention layer, a hybrid stack, Mamba-2 layers alone, or a mixer
    beside attention in every layer), `multipliers` (constant factors), `per_layer` (inputs).

    Whole-model switches: `family` (a name of the families registry), `tie_embeddings`,
    `embed_scale` (multiply token embeddings by sqrt(d_model), as Gemma does), `final_softcap`
    (cap * tanh(x / cap) on the final logits, Gemma 2), `parallel_residual` (each block adds
    attention and MLP, both of its input, in one step: x + attn(norm1(x)) + mlp(norm2(x)), as
    GPT-J and GPT-NeoX do; False: the MLP reads the attention's output).

    Numerics and compilation: `param_dtype`, `compute_dtype` (activations and matmuls; norms,
    softmax and the loss stay fp32), `scan_layers` (False unrolls the layer loop: faster steps
    on shallow models, compile time growing with depth), `remat` (jax.checkpoint policy for each
    block; a remat policy always runs the layers with lax.scan, because unrolled XLA schedules
    the recomputation early and the memory saving disappears), `init_std`.

    Parametrization (`eqllm.parametrization`, docs/scaling-laws.md): `parametrization` "sp",
    "mup" or "completep"; `base_d_model` and `base_n_layers` (None: this model's own) are the
    width and depth at which muP / CompleteP equal SP exactly; `output_mult` multiplies the
    muP readout.
    """

    PATH: ClassVar[str] = "ModelConfig"

    vocab_size: Positive
    d_model: Positive
    n_layers: Positive
    max_seq_len: Positive
    attention: AttentionConfig
    mlp: MLPConfig
    positions: PositionsConfig = dataclasses.field(default_factory=PositionsConfig)
    norms: NormsConfig = dataclasses.field(default_factory=NormsConfig)
    moe: MoEConfig | None = None
    linear: LinearAttentionConfig | None = None
    multipliers: MultipliersConfig | None = None
    per_layer: PerLayerConfig | None = None
    family: Annotated[Family, Field(min_length=1)] = "llama"
    tie_embeddings: bool = False
    embed_scale: bool = False
    parallel_residual: bool = False
    final_softcap: PositiveFloat | None = None
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    scan_layers: bool = True
    remat: RematPolicy = "none"
    init_std: PositiveFloat = 0.02
    parametrization: Parametrization = "sp"
    base_d_model: Positive | None = None
    base_n_layers: Positive | None = None
    output_mult: PositiveFloat = 1.0

    @staticmethod
    def _prepare(values: dict[str, Any]) -> dict[str, Any]:
        """Expand dotted keys and build the groups given as dicts (their errors name their own
        paths)."""
        return {
            k: GROUPS[k](**v) if k in GROUPS and isinstance(v, dict) else v
            for k, v in expand(values).items()
        }

    def __post_init__(self) -> None:
        # Runs after pydantic's field checks. Derived sizes are filled in once, here.
        attn, pos = self.attention, self.positions
        if attn.head_dim is None:
            require(
                self.d_model % attn.n_heads == 0,
                "ModelConfig.attention.n_heads",
                attn.n_heads,
                f"must divide d_model={self.d_model} (or set attention.head_dim explicitly)",
            )
            attn = dataclasses.replace(attn, head_dim=self.d_model // attn.n_heads)
            object.__setattr__(self, "attention", attn)
        if pos.kind == "rope":
            even = self.rotary_dim % 2 == 0 and self.rotary_dim > 0
            if pos.fraction == 1 and attn.kind == "mla":
                require(
                    even,
                    "ModelConfig.attention.qk_rope_head_dim",
                    attn.qk_rope_head_dim,
                    "must be even with rotary positions",
                )
            elif pos.fraction == 1:
                require(
                    even,
                    "ModelConfig.attention.head_dim",
                    attn.head_dim,
                    "must be even with rotary positions",
                )
            require(
                even,
                "ModelConfig.positions.fraction",
                pos.fraction,
                f"must rotate an even, non-zero number of dims (head_dim={attn.head_dim})",
            )
        require(
            not (attn.rope_interleave and attn.kind == "gqa") or pos.fraction == 1,
            "ModelConfig.positions.fraction",
            pos.fraction,
            "must be 1 with attention.rope_interleave (every dim of the head is paired)",
        )
        scaling = pos.scaling
        if scaling is not None and scaling.kind == "longrope":
            require(
                len(scaling.short_factor) == self.rotary_dim // 2,
                "ModelConfig.positions.scaling.short_factor",
                list(scaling.short_factor),
                f"must have one entry per rotated frequency ({self.rotary_dim // 2})",
            )
        require(
            pos.local_theta is None or attn.global_every is not None,
            "ModelConfig.positions.local_theta",
            pos.local_theta,
            "needs attention.global_every (it is the base of the windowed layers)",
        )
        require(
            self.parametrization == "sp" or self.moe is None,
            "ModelConfig.parametrization",
            self.parametrization,
            "is only defined for dense models here (a router's width scaling is not); use 'sp' "
            "with moe",
        )
        if self.linear is not None:
            check_hybrid(self)
        check_sharing(self)
        if self.moe is not None:
            require(
                set(self.layer_kinds()) != {"dense"},
                "ModelConfig.moe.dense_layers",
                self.moe.dense_layers,
                f"leaves no layer with the experts (n_layers={self.n_layers}, sparse_every="
                f"{self.moe.sparse_every}); some layers must have them",
            )
            kind = {"relu2": "relu2", "geglu": "geglu"}.get(self.moe.activation, "swiglu")
            require(
                self.mlp.kind == kind,
                "ModelConfig.mlp.kind",
                self.mlp.kind,
                f"must be {kind!r} with moe.activation={self.moe.activation!r} (the experts')",
            )

    @property
    def head_dim(self) -> int:  # `attention.head_dim`, filled in at construction
        return self.attention.head_dim

    @property
    def expert_d_ff(self) -> int:
        """The hidden size of each routed expert."""
        return (self.moe.d_ff if self.moe is not None else None) or self.mlp.d_ff

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the leading ones; latent: qk_rope_head_dim)."""
        if self.attention.kind == "mla":
            return self.attention.qk_rope_head_dim
        return int(self.attention.head_dim * self.positions.fraction)

    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer, the kind of stack it belongs to; see `eqllm.config.kinds`."""
        return layer_kinds(self)

    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the window or its chunk (True), or to everything?"""
        if self.attention.sliding_window is None and self.attention.chunk_size is None:
            return (False,) * self.n_layers
        every = self.attention.global_every
        return tuple(every is None or (i + 1) % every != 0 for i in range(self.n_layers))

    def rotary_layers(self) -> tuple[bool, ...]:
        """Per layer: rotary (True), or NoPE (positions.nope_every; every layer without RoPE)?"""
        if self.positions.kind != "rope":
            return (False,) * self.n_layers
        every = self.positions.nope_every
        return tuple(every is None or (i + 1) % every != 0 for i in range(self.n_layers))

    def at(self, path: str) -> Any:
        """The value at a dotted path ("attention.n_kv_heads"); None below a group that is
        None ("moe.n_experts" of a dense model)."""
        value: Any = self
        for part in path.split("."):
            if value is None:
                return None
            if not dataclasses.is_dataclass(value) or part not in value.__pydantic_fields__:
                raise unknown_field(type(value), part)
            value = getattr(value, part)
        return value

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with some settings changed (validated); unknown names list the valid ones.

        Keys are field names or dotted paths (`**{"attention.n_kv_heads": 2}`); a dict value
        for a group changes only the fields it names (`attention={"n_kv_heads": 2}`), None
        removes an optional group (`moe=None`). A RoPE scaling of another kind replaces the
        old one whole.

        Sizes that equal their default count as derived and follow the fields they derive from
        unless `overrides` sets them too: attention.head_dim == d_model // n_heads follows
        d_model and attention.n_heads, attention.n_kv_heads == n_heads (multi-head attention)
        follows attention.n_heads.
        """
        changes = expand(overrides)
        check_names(changes)
        values = self.to_dict()
        attn = values["attention"]
        new_attn = changes.get("attention") if isinstance(changes.get("attention"), dict) else {}
        if attn["head_dim"] == self.d_model // attn["n_heads"] and (
            "d_model" in changes or "n_heads" in new_attn
        ):
            attn["head_dim"] = None
        if attn["n_kv_heads"] == attn["n_heads"] and "n_heads" in new_attn:
            attn["n_kv_heads"] = None
        return ModelConfig.from_dict(merge(values, changes))

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts, a group's fields under its name (None for a missing group)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """A config from nested dicts and/or dotted keys (as `to_dict` writes and TOML reads).

        The flat layout of earlier eqllm versions (`n_heads`, `rope_theta`, ... at the top, as
        their run and model folders hold it) is read too, through `eqllm.config.legacy.FLAT_NAMES`.
        """
        values = expand(from_flat(values))
        check_names(values)
        fields = cls.__pydantic_fields__
        missing = [n for n, f in fields.items() if f.is_required() and n not in values]
        if missing:
            raise ConfigError(f"ModelConfig is missing required field(s) {', '.join(missing)}")
        return cls(**values)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 * matmul parameters + 12 * L * H * Q * T for attention.

        With experts, the matmul parameters are the active ones: the router, the
        `experts_per_token` experts a token reaches and the shared expert. Matmul parameters
        exclude the embedding table unless it is tied into the LM head (then it is counted
        once, as the head); a hybrid's linear-attention layers count their projections (the
        delta rule's own products, linear in T, are left out). Attention uses the PaLM
        convention (appendix B) without halving for the causal mask; T is `seq_len` (default:
        max_seq_len), capped by the sliding window in the layers that have it. Global layers
        of their own shape (Gemma 4) count their own head size and kv heads.
        """
        return flops.flops_per_token(self, seq_len)

    def attention_flops_per_token(self, seq_len: int | None = None) -> float:
        """6 * L * H * (Q + V) * T: attention scores (query/key size Q) and weighted sums (value
        size V), forward (2) and backward (4); 12 * L * H * Q * T where values are as wide as
        keys (all but latent attention). T is `seq_len` (default: max_seq_len), capped by the
        sliding window where it applies."""
        return flops.attention_flops_per_token(self, seq_len)


def field_names() -> list[str]:
    """ModelConfig's top-level fields (groups by their names), in order."""
    return list(ModelConfig.__pydantic_fields__)


def check_names(values: dict[str, Any], cls: type = ModelConfig, group: str = "") -> None:
    """Raise for a name that is not a field of `cls` (or of a group below it)."""
    for key, value in values.items():
        if key not in cls.__pydantic_fields__:
            raise unknown_field(cls, key)
        sub = GROUPS.get(key) if cls is ModelConfig else SUBGROUPS.get((group, key))
        if sub is not None and isinstance(value, dict):
            check_names(value, sub, key)
