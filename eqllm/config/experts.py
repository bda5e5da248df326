"""The mixture-of-experts group of ModelConfig (`ModelConfig.moe`)."""

from __future__ import annotations

import typing
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from eqllm.config.validation import (
    STRICT,
    ConfigError,
    Positive,
    PositiveFloat,
    config_error,
    require,
    validated,
)

MoEImpl = Literal["auto", "dense", "ragged", "dispatch"]
MoEKernel = Literal["auto", "xla", "megablox"]
ExpertActivation = Literal["swiglu", "clamped_swiglu", "relu2", "geglu"]
Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]
BalanceLoss = Literal["switch", "sequence"]

_group = validated(STRICT, config_error)
# Gemma 4's router and branch switches off (every other mixture family's `fixed`, by dotted path).
PLAIN_ROUTER = {"moe.router_norm": False, "moe.expert_scale": False, "moe.branch_norms": False}


@typing.no_type_check
@_group
class MoEConfig:
    """A sparse mixture of experts in place of every block's MLP.

    `n_experts` routed SwiGLU experts of hidden size `d_ff` (None: mlp.d_ff), `experts_per_token`
    of them per token, their top-k router probabilities renormalised when `norm_topk_prob`;
    `shared_d_ff` adds Qwen-MoE's gated shared expert; `aux_loss_coef` weighs the load-balancing
    loss in training; `impl` picks how the experts are computed ("dense": every expert on every
    token, fastest on CPU; "ragged": grouped matmul; "dispatch": expert parallelism by token
    dispatch, each token copy sent to the device holding its expert and back, eqllm.nn.dispatch;
    "auto", the default: chosen per backend and mesh by `choose_impl`), same values;
    `kernel`: the grouped matmul of "ragged" and "dispatch" ("xla": `jax.lax.ragged_dot`;
    "megablox": the TPU grouped-matmul kernels, whose weight gradient is grouped too; "auto":
    `choose_kernel`). `capacity_factor` ("dispatch" only; None: dropless) bounds the copies one
    device receives from another at that multiple of a fair share and drops the rest. `bias`:
    biases on the router and every expert's projections (gpt-oss). `activation`: "swiglu"
    (silu(gate) * up) or "clamped_swiglu" (gpt-oss: g = min(gate, swiglu_limit),
    (clip(up, +-swiglu_limit) + 1) * g * sigmoid(swiglu_alpha * g)) or "relu2": ungated
    experts, down(relu(up(x))^2) with no gate projection, and an ungated squared-ReLU shared
    expert too (Nemotron 3); `swiglu_alpha` and `swiglu_limit` are set exactly when the
    activation is clamped.

    DeepSeek's settings: `shared_gated` False adds the shared expert without Qwen's gate
    (shared_d_ff = n_shared_experts * moe_intermediate_size); `scoring` "softmax" (V2) or
    "sigmoid" (V3) router scores; `score_bias`: V3's e_score_correction_bias, added to the
    scores to choose experts and not to weigh them, moved after each training step by
    `bias_update_speed` toward equal load (0: left as it is) outside the gradient;
    `n_groups` / `topk_groups`: each token chooses among the best topk_groups of n_groups
    groups of experts, a group scored by `group_score` ("max": V2, "top2_sum": V3);
    `routed_scale` multiplies the routed weights; the first `dense_layers` layers have a dense
    MLP of mlp.d_ff instead of experts, and so has every layer but each `sparse_every`-th
    (counting from 1; Llama 4 Maverick's interleave_moe_layer_step 2: dense and expert layers
    alternate). `balance_loss`: what aux_loss_coef weighs, "switch"
    (transformers' load-balancing loss over all of a batch's tokens) or "sequence" (DeepSeek-V3's
    sequence-wise balance loss, under each layer's own routing). `score_input`: each routed
    weight scales its expert's input rather than its output (Llama 4's experts read the token
    times its sigmoid router score).

    Gemma 4's block (26B-A4B): `activation` "geglu" (tanh-GELU gated experts, and shared expert);
    `branch_norms`: the shared expert (Gemma 4's dense MLP, ungated, shared_d_ff = mlp.d_ff)
    and the routed experts each read the residual through a norm of their own and norm their
    outputs before they are summed; the block's norm before the feed-forward layer goes, its
    norm after it norms the sum (needs shared_d_ff). `router_norm`: the router reads the
    residual through a weightless RMSNorm times a learned scale times d_model^-0.5;
    `expert_scale`: a learned scale per expert multiplies its renormalised routed weight.
    """

    PATH: ClassVar[str] = "ModelConfig.moe"

    n_experts: Positive
    experts_per_token: Positive = 2
    d_ff: Positive | None = None
    norm_topk_prob: bool = True
    shared_d_ff: Positive | None = None
    aux_loss_coef: Annotated[float, Field(ge=0)] = 0.0
    impl: MoEImpl = "auto"
    kernel: MoEKernel = "auto"
    capacity_factor: PositiveFloat | None = None
    bias: bool = False
    activation: ExpertActivation = "swiglu"
    swiglu_alpha: PositiveFloat | None = None
    swiglu_limit: PositiveFloat | None = None
    shared_gated: bool = True
    scoring: Scoring = "softmax"
    score_bias: bool = False
    bias_update_speed: Annotated[float, Field(ge=0)] = 0.0
    n_groups: Positive | None = None
    topk_groups: Positive | None = None
    group_score: GroupScore = "max"
    routed_scale: PositiveFloat = 1.0
    dense_layers: Annotated[int, Field(ge=0)] = 0
    sparse_every: Positive = 1
    balance_loss: BalanceLoss = "switch"
    score_input: bool = False
    router_norm: bool = False
    expert_scale: bool = False
    branch_norms: bool = False

    @property
    def gated(self) -> bool:
        """Whether each expert (and the shared one) has a gate projection: every activation
        but "relu2"."""
        return self.activation != "relu2"

    def __post_init__(self) -> None:
        require(
            (self.n_groups is None) == (self.topk_groups is None),
            f"{self.PATH}.topk_groups",
            self.topk_groups,
            f"must be set exactly when n_groups is (n_groups={self.n_groups})",
        )
        if self.n_groups is not None:
            require(
                self.n_experts % self.n_groups == 0,
                f"{self.PATH}.n_groups",
                self.n_groups,
                f"must divide n_experts={self.n_experts}",
            )
            require(
                self.topk_groups <= self.n_groups,
                f"{self.PATH}.topk_groups",
                self.topk_groups,
                f"must be <= n_groups={self.n_groups}",
            )
        require(
            self.bias_update_speed == 0 or self.score_bias,
            f"{self.PATH}.bias_update_speed",
            self.bias_update_speed,
            "needs score_bias=true (it moves the correction bias)",
        )
        require(
            self.experts_per_token <= self.n_experts,
            f"{self.PATH}.experts_per_token",
            self.experts_per_token,
            f"must be <= n_experts={self.n_experts}",
        )
        require(
            self.capacity_factor is None or self.impl == "dispatch",
            f"{self.PATH}.capacity_factor",
            self.capacity_factor,
            "is only read by impl='dispatch'; set moe.impl='dispatch' or leave it unset",
        )
        require(
            not self.branch_norms or self.shared_d_ff is not None,
            f"{self.PATH}.branch_norms",
            self.branch_norms,
            "needs a shared expert: set shared_d_ff (Gemma 4's dense MLP)",
        )
        clamped = self.activation == "clamped_swiglu"
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            require(
                (value is not None) == clamped,
                f"{self.PATH}.{name}",
                value,
                "must be set for activation='clamped_swiglu'"
                if clamped
                else "is only read by activation='clamped_swiglu'",
            )


def choose_impl(
    requested: str, *, backend: str, expert_shards: int, n_experts: int
) -> tuple[str, str]:
    """(the experts' computation, why) for `moe.impl = requested` on `backend` ("cpu", "gpu",
    "tpu") with the experts' mesh axis of `expert_shards` devices (1: no mesh splits them).

    An explicit impl is kept. "auto" (measured in docs/moe.md and
    docs/experiments/moe_vs_dense.md): on CPU "dense", since XLA lowers `ragged_dot` there to a
    masked product over every expert, so plain batched matmuls are faster (ragged 1.15x slower
    on one device, dispatch 1.4-1.6x slower dropless on 8 simulated devices); on an accelerator
    "dispatch" where the mesh splits the experts (each device computes only its routed rows, and
    the dense product costs n_experts / k times the useful FLOPs: deepseek-v3 with dense
    experts does not fit 512 v5p chips), else "ragged" (grouped kernels, the useful rows only).
    """
    if requested != "auto":
        return requested, "set by moe.impl"
    if backend == "cpu":
        return "dense", "auto on cpu: dense experts are fastest there (grouped matmul is masked)"
    if expert_shards > 1 and n_experts % expert_shards == 0:
        return "dispatch", (
            f"auto on {backend}: the mesh splits the experts over {expert_shards} devices"
        )
    return "ragged", f"auto on {backend}: grouped matmul over the routed rows only"


def choose_kernel(
    requested: str, *, backend: str, impl: str, devices: int = 1, expert_shards: int = 1
) -> str:
    """The grouped matmul for `moe.kernel = requested` on `backend`, for experts computed as
    `impl` on `devices` devices whose experts' axis has `expert_shards`.

    "megablox" is a Pallas kernel, which the compiler cannot partition over a mesh: it runs
    inside `shard_map`, where each device calls it on its own rows (impl "dispatch" or
    "ragged" with an expert axis of more than one device, `eqllm.sharding.ExpertDispatch`), or
    on one device. "auto" is "megablox" there on
    TPU (the TPU compiler lowers the weight gradient of `jax.lax.ragged_dot` to a dense product
    over every local expert and row: docs/moe.md), else "xla"; an explicit "megablox" elsewhere
    is refused."""
    partitioned = devices > 1 and not (impl in ("dispatch", "ragged") and expert_shards > 1)
    if requested == "auto":
        return "megablox" if backend == "tpu" and not partitioned else "xla"
    if requested == "megablox" and partitioned:
        raise ConfigError(
            f"moe.kernel='megablox' with moe.impl={impl!r} on {devices} devices: the compiler "
            "cannot split a Pallas kernel over a mesh; set moe.kernel to 'auto' or 'xla', or "
            "split the experts' axis (fsdp) over more than one device"
        )
    return requested


# The plain experts every mixture family but gpt-oss has: no biases, SwiGLU (and no Gemma 4
# router or branch norms). A MoE family adds these to its `fixed`, so export refuses the others'.
PLAIN_EXPERTS = {
    **PLAIN_ROUTER,
    "moe.bias": False,
    "moe.activation": "swiglu",
    "moe.scoring": "softmax",
    "moe.score_bias": False,
    "moe.n_groups": None,
    "moe.routed_scale": 1.0,
    "moe.dense_layers": 0,
    "moe.sparse_every": 1,
    "moe.score_input": False,
}
