"""The groups of ModelConfig: one frozen, validated dataclass per mechanism.

A family either has a mechanism (the group, with its settings) or leaves it None (`moe`, a RoPE
`scaling`), so a feature's settings live in one place instead of defaults spread over flat
fields. Each group validates its own fields at construction; its errors name the full dotted
path (`ModelConfig.attention.n_kv_heads=3 must divide n_heads=8`). Checks that need fields of
several groups live in `ModelConfig.__post_init__`.
"""

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

NormKind = Literal["rmsnorm", "layernorm"]
MLPKind = Literal["gelu", "swiglu", "geglu", "relu2"]
GeluForm = Literal["tanh", "exact"]
QKNorm = Literal["head", "whole", "l2"]
AttentionKernel = Literal["auto", "xla", "cudnn"]
AttentionKind = Literal["gqa", "mla"]
# The latent attention sizes: set exactly when attention.kind is "mla" (q_lora_rank optional).
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

_group = validated(STRICT, config_error)


@typing.no_type_check  # pydantic checks the fields (the test suite's beartype hook need not)
@_group
class AttentionConfig:
    """Self-attention: heads and their sizes, biases, QK-norm, soft-cap, windows, scale, kernel.

    `n_kv_heads` (== n_heads: multi-head; 1: multi-query; otherwise grouped-query; None at
    construction means n_heads), `head_dim` (None means d_model // n_heads, filled in by
    ModelConfig). `qk_norm`: an RMSNorm on queries and keys, over each head ("head": Qwen3,
    Gemma 3) or over the whole projections ("whole": OLMo 2), or "l2": a weightless RMSNorm
    over each head in the rotary layers only (Llama 4's use_qk_norm); None: none. `softcap`:
    cap * tanh(scores / cap) (Gemma 2). `sliding_window` (None: full causal attention) with
    `global_every` (every global_every-th layer attends to the whole context; None: every layer
    uses the window). `chunk_size` (None: none): the local layers attend within fixed chunks
    of positions instead of a window, query p to keys q <= p with q // chunk_size == p //
    chunk_size (Llama 4's chunked attention; exclusive with `sliding_window`).
    `temperature_floor` / `temperature_scale` (both or neither): the queries of the NoPE layers
    (`positions.nope_every`) are scaled by 1 + temperature_scale * log1p(floor((p + 1) /
    temperature_floor)) at position p (Llama 4's attention-temperature tuning, floor_scale and
    attn_scale). `rope_interleave` with "gqa": rotary pairs are adjacent dims (Llama 4's complex
    rotation) rather than rotate-half. `query_pre_attn_scalar`: scores scaled by its inverse
    square root instead of head_dim's. `sinks`: a learned logit per query head joins the
    softmax denominator (gpt-oss's attention sinks: probability mass with no value).
    `kernel`: "xla" computes attention in the model, "cudnn" uses cuDNN's fused kernel, "auto"
    the fused kernel where it can run (see `eqllm.attention_backend`).

    `output_gate`: the heads' output is multiplied by sigmoid of a second query-sized
    projection of the input before the output projection (Qwen3-Next and Qwen3.5's gated
    attention). `v_norm`: values pass a weightless RMSNorm over each head (Gemma 4).

    Global layers of another shape (Gemma 4; each None/False: the local layers' own):
    `global_head_dim` and `global_kv_heads` size the heads of the layers without the window, and
    `k_eq_v` gives those layers no value projection (their values are the keys before norm and
    rotation). Any of them puts the global layers in a stack of their own (layer kind
    "global", `eqllm.config.kinds`); they need `global_every`.

    `kind` "gqa": the attention above; "mla": DeepSeek's multi-head latent attention
    (`eqllm.nn.mla`), keys and values from a shared `kv_lora_rank` latent, per-head
    `qk_nope_head_dim` and rotated `qk_rope_head_dim` query/key parts and `v_head_dim` values,
    queries through a `q_lora_rank` latent (None: projected directly), `rope_interleave`:
    rotated dims in interleaved pairs (DeepSeek's checkpoints). head_dim is then
    qk_nope_head_dim + qk_rope_head_dim, `qkv_bias` and `out_bias` (equal) bias q_a/kv_a/o, and
    n_kv_heads equals n_heads.
    """

    PATH: ClassVar[str] = "ModelConfig.attention"

    n_heads: Positive
    n_kv_heads: Positive | None = None
    head_dim: Positive | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: QKNorm | None = None
    softcap: PositiveFloat | None = None
    sliding_window: Positive | None = None
    global_every: Positive | None = None
    query_pre_attn_scalar: Positive | None = None
    sinks: bool = False
    kernel: AttentionKernel = "auto"
    kind: AttentionKind = "gqa"
    q_lora_rank: Positive | None = None
    kv_lora_rank: Positive | None = None
    qk_nope_head_dim: Positive | None = None
    qk_rope_head_dim: Positive | None = None
    v_head_dim: Positive | None = None
    rope_interleave: bool = False
    output_gate: bool = False
    chunk_size: Positive | None = None
    temperature_floor: Positive | None = None
    temperature_scale: PositiveFloat | None = None
    v_norm: bool = False
    global_head_dim: Positive | None = None
    global_kv_heads: Positive | None = None
    k_eq_v: bool = False
    kv_shared_layers: Positive | None = None  # eqllm.config.per_layer

    @property
    def global_shape(self) -> bool:
        """Whether the global layers differ from the local ones (a stack of their own)."""
        return self.global_head_dim is not None or self.global_kv_heads is not None or self.k_eq_v

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        mla = self.kind == "mla"
        for name in (*MLA_FIELDS, "q_lora_rank"):
            value = getattr(self, name)
            if not mla:
                require(value in (None, False), f"{self.PATH}.{name}", value, "needs kind='mla'")
            elif name in MLA_FIELDS:
                require(value is not None, f"{self.PATH}.{name}", value, "must be set for 'mla'")
        if mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim is None:
                object.__setattr__(self, "head_dim", qk)
            plain = {
                "head_dim": qk,
                "n_kv_heads": self.n_heads,
                "out_bias": self.qkv_bias,
                "qk_norm": None,
                "softcap": None,
                "sliding_window": None,
                "query_pre_attn_scalar": None,
                "sinks": False,
                "output_gate": False,
                "chunk_size": None,
                "temperature_floor": None,
                "v_norm": False,
            }
            for name, wanted in plain.items():
                value = getattr(self, name)
                require(
                    value == wanted, f"{self.PATH}.{name}", value, f"must be {wanted} with 'mla'"
                )
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"{self.PATH}.n_kv_heads",
            self.n_kv_heads,
            f"must divide n_heads={self.n_heads}",
        )
        require(
            self.global_every is None
            or self.sliding_window is not None
            or self.chunk_size is not None,
            f"{self.PATH}.global_every",
            self.global_every,
            "needs a sliding_window or a chunk_size for the other layers",
        )
        require(
            not self.global_shape or self.global_every is not None,
            f"{self.PATH}.global_every",
            self.global_every,
            "must be set with global_head_dim, global_kv_heads or k_eq_v (they shape its layers)",
        )
        require(
            self.global_kv_heads is None or self.n_heads % self.global_kv_heads == 0,
            f"{self.PATH}.global_kv_heads",
            self.global_kv_heads,
            f"must divide n_heads={self.n_heads}",
        )
        require(
            self.chunk_size is None or self.sliding_window is None,
            f"{self.PATH}.chunk_size",
            self.chunk_size,
            f"cannot combine with sliding_window={self.sliding_window}; set one of them",
        )
        require(
            (self.temperature_floor is None) == (self.temperature_scale is None),
            f"{self.PATH}.temperature_scale",
            self.temperature_scale,
            f"must be set exactly when temperature_floor is ({self.temperature_floor})",
        )


@typing.no_type_check
@_group
class MLPConfig:
    """The feed-forward layer: `kind` (gelu: GPT-2's; swiglu / geglu: gated; relu2: squared ReLU,
    ungated, Nemotron-H's), `d_ff` hidden
    units, `bias` on its projections, `gelu` the form of kind 'gelu''s activation ("tanh": the
    tanh approximation, GPT-2's gelu_new; "exact": the erf form, GPT-NeoX's gelu)."""

    PATH: ClassVar[str] = "ModelConfig.mlp"

    d_ff: Positive
    kind: MLPKind = "swiglu"
    bias: bool = False
    gelu: GeluForm = "tanh"
    kv_shared_d_ff: Positive | None = None  # the kv-shared layers' (eqllm.config.per_layer)

    def __post_init__(self) -> None:
        require(
            self.gelu == "tanh" or self.kind == "gelu",
            f"{self.PATH}.gelu",
            self.gelu,
            "is only defined for kind='gelu' (geglu uses the tanh form)",
        )


@typing.no_type_check
@_group
class NormsConfig:
    """The norms: `kind`, `eps`, `plus_one` (Gemma's (1 + w) RMSNorm scale), `bias` (LayerNorm
    only), `pre` (a norm before each sublayer) and `post` (one on each sublayer's output before
    the residual add: Gemma 2/3 have both, OLMo 2 only the latter). `layer_scalar`: each block's
    output is multiplied by a stored scalar of its own (Gemma 4's `layer_scalar`, 1 at init)."""

    PATH: ClassVar[str] = "ModelConfig.norms"

    kind: NormKind = "rmsnorm"
    eps: PositiveFloat = 1e-5
    plus_one: bool = False
    bias: bool = False
    pre: bool = True
    post: bool = False
    layer_scalar: bool = False

    def __post_init__(self) -> None:
        require(
            not (self.bias and self.kind == "rmsnorm"),
            f"{self.PATH}.bias",
            self.bias,
            "is only defined for kind='layernorm'",
        )
        require(
            not (self.plus_one and self.kind == "layernorm"),
            f"{self.PATH}.plus_one",
            self.plus_one,
            "is only defined for kind='rmsnorm'",
        )


from eqllm.config.experts import MoEConfig  # noqa: E402  (it uses the helpers above)
from eqllm.config.linear import LinearAttentionConfig  # noqa: E402
from eqllm.config.multipliers import MultipliersConfig  # noqa: E402
from eqllm.config.per_layer import PerLayerConfig  # noqa: E402
from eqllm.config.positions import PositionsConfig, RopeScalingConfig  # noqa: E402

# The groups ModelConfig holds, by field name.
GROUPS: dict[str, type] = {
    "attention": AttentionConfig,
    "positions": PositionsConfig,
    "mlp": MLPConfig,
    "moe": MoEConfig,
    "norms": NormsConfig,
    "linear": LinearAttentionConfig,
    "multipliers": MultipliersConfig,
    "per_layer": PerLayerConfig,
}
# Groups nested inside a group, by (group, field).
SUBGROUPS: dict[tuple[str, str], type] = {("positions", "scaling"): RopeScalingConfig}
