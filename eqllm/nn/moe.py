"""Sparse mixture-of-experts feed-forward layer: Mixtral (Jiang et al., 2024), Qwen-MoE with a
gated shared expert (Qwen Team, 2024), OLMoE (Muennighoff et al., 2024), Nemotron 3's ungated
squared-ReLU experts (NVIDIA, 2025); the load-balancing loss of the Switch Transformer (Fedus et
al., 2021) as transformers computes it.

Routing is transformers': softmax over all experts in fp32, the top k, renormalised to sum to 1
where the family does it, cast to the compute dtype (gpt-oss's softmax over the top k logits is
the renormalised case). Dropless: every token reaches its k experts (no capacity factor), so
the outputs equal transformers'. Three ways to compute the experts give the same values:
"dense" runs every expert on every token and combines with a [tokens, experts] matrix that is
zero off the top k (k/E of the work is useful, but it is plain batched matmuls);
"ragged" sorts the token copies by expert and runs `jax.lax.ragged_dot` (grouped matmul: the
useful work only, on backends with a grouped kernel; XLA on CPU lowers it to a masked dense
product that costs every expert on every row); "dispatch" sends each token copy to the device
that holds its expert and back (all-to-all) and runs the local experts as one grouped matmul
(`eqllm.nn.dispatch`: expert parallelism by token dispatch; on one device, "ragged" by
another road), optionally with a capacity factor that drops copies past it.

Gemma 4 (26B-A4B) runs its dense MLP beside the experts as an ungated shared expert, each
branch normed before and after (`branch_norms`), with `router_norm` and `expert_scale`.

Expert parallelism of the dense product: given `ExpertHooks` with a placement `place`
(`MoE.routed(x, hooks=...)`), the dense product passes its intermediates through
`place(array, logical_axes)`, so a caller that knows the mesh (the FSDP layer hook,
`eqllm.sharding.FsdpGather`) can place them: the [experts, tokens, ...] arrays split over
experts, so that each device runs only its own experts, on every token.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqllm.nn.dispatch import ExpertHooks, dispatched, placement
from eqllm.nn.linear import ExpertLinear, Linear
from eqllm.nn.mlp import MLP, GatedMLP, clamped_swiglu, gated
from eqllm.nn.moe_choice import limited_choice
from eqllm.nn.norm import RMSNorm, apply_norm, unit_rms

MoEImpl = Literal["dense", "ragged", "dispatch"]
ExpertActivation = Literal["swiglu", "clamped_swiglu", "relu2", "geglu"]
Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]


class Routing(NamedTuple):
    """What a mixture of experts' router did on a forward: its logits (for the balance
    losses), the token copies each expert was sent (the routed ids' counts, dropped copies
    included: the expert load, measured here once for every impl) and the copies dropped past
    the capacity (`MoE.capacity_factor`; 0 dropless), summed over the batch's devices."""

    logits: Float[Array, "*rows experts"]
    load: Int[Array, " experts"]
    dropped: Int[Array, ""]


class MoE(eqx.Module):
    """sum over the top-k experts e of w_e * down_e(silu(gate_e(x)) * up_e(x)), plus
    sigmoid(shared_gate(x)) * shared(x) where there is a shared expert (shared(x) alone when it
    is ungated, DeepSeek's); gpt-oss's experts use `clamped_swiglu` in place of silu(gate) * up
    and biases on the router and the experts; Nemotron 3's experts have no gate projection
    (activation "relu2": down_e(relu(up_e(x))^2), and its shared expert likewise).

    DeepSeek's routing (V2: softmax, V3: sigmoid scores) may restrict each token to the
    `topk_groups` best of `n_groups` equal groups of experts (a group scored by its best
    expert, "max", V2, or its best two summed, "top2_sum", V3), choose by the scores plus a
    correction bias (`score_bias`, V3's e_score_correction_bias: selection only, the weights
    are the scores themselves, and no gradient reaches it) and multiply the weights by
    `routed_scale`.

    Arguments:
        d_model: input and output size.
        d_ff: hidden size of each expert.
        n_experts: number of routed experts.
        top_k: experts per token.
        normalize: renormalise the top-k probabilities to sum to 1 (Mixtral; Qwen-MoE and
            OLMoE by `norm_topk_prob`).
        shared_d_ff: hidden size of the always-on shared expert (None: none).
        impl: "dense", "ragged" or "dispatch" (see the module docstring); the values are the
            same (dropless).
        kernel: the grouped matmul of "ragged" and "dispatch", "xla" (`jax.lax.ragged_dot`) or
            "megablox" (TPU kernels; `eqllm.nn.ExpertLinear.grouped`).
        capacity_factor: "dispatch" only: each device receives at most this multiple of a
            fair share of another's token copies (None: dropless).
        bias: biases on the router and on every expert's projections (gpt-oss).
        activation: "swiglu" (silu(gate) * up), "clamped_swiglu" (`clamped_swiglu`, which
            reads `swiglu_alpha` and `swiglu_limit`) or "relu2" (relu(up)^2: ungated experts,
            `gate` None, and an ungated squared-ReLU shared expert, `eqllm.nn.MLP`).
        shared_gated: the shared expert's output passes through a sigmoid gate (Qwen-MoE);
            False adds it as it is (DeepSeek).
        scoring: "softmax" over all experts or an independent "sigmoid" per expert.
        score_bias: a correction bias added to the scores for choosing only (zeros at first).
        n_groups: experts split into this many groups (None: no group limit).
        topk_groups: groups each token may choose from.
        group_score: how a group is scored, "max" or "top2_sum".
        routed_scale: multiplies the routed weights.
        score_input: each routed weight scales its expert's input, w_e * x, not the expert's
            output (Llama 4; equal only for a linear expert). "dispatch" takes it with one
            expert per token.
        router_norm: the router reads rms_norm(x) * router_scale * d_model^-0.5: a weightless
            RMSNorm (`norm_eps`), a learned scale (Gemma 4's router.scale).
        expert_scale: a learned scale per expert on its renormalised weight (per_expert_scale).
        branch_norms: the shared expert and the experts each read x through an RMSNorm of their
            own (`norm_eps`, `norm_plus_one`) and norm their outputs before the sum (Gemma 4's
            pre/post_feedforward_layernorm_1/_2); needs `shared_d_ff`. "geglu": tanh GELU.
    """

    router: Linear  # (n_experts, d_model)
    gate: ExpertLinear | None  # (n_experts, d_ff, d_model); None: ungated experts ("relu2")
    up: ExpertLinear  # (n_experts, d_ff, d_model)
    down: ExpertLinear  # (n_experts, d_model, d_ff)
    shared: GatedMLP | MLP | None
    shared_gate: Linear | None  # (1, d_model)
    score_bias: Float[Array, " experts"] | None
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True)
    impl: MoEImpl = eqx.field(static=True)
    kernel: str = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    activation: ExpertActivation = eqx.field(static=True)
    swiglu_alpha: float | None = eqx.field(static=True)
    swiglu_limit: float | None = eqx.field(static=True)
    scoring: Scoring = eqx.field(static=True)
    n_groups: int | None = eqx.field(static=True)
    topk_groups: int | None = eqx.field(static=True)
    group_score: GroupScore = eqx.field(static=True)
    routed_scale: float = eqx.field(static=True)
    score_input: bool = eqx.field(static=True, default=False)
    router_scale: Float[Array, " d_model"] | None = None
    expert_scale: Float[Array, " experts"] | None = None
    shared_norm: RMSNorm | None = None
    shared_post_norm: RMSNorm | None = None
    experts_norm: RMSNorm | None = None
    experts_post_norm: RMSNorm | None = None
    router_eps: float | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        *,
        normalize: bool = True,
        shared_d_ff: int | None = None,
        impl: MoEImpl = "dense",
        kernel: str = "xla",
        capacity_factor: float | None = None,
        bias: bool = False,
        activation: ExpertActivation = "swiglu",
        swiglu_alpha: float | None = None,
        swiglu_limit: float | None = None,
        shared_gated: bool = True,
        scoring: Scoring = "softmax",
        score_bias: bool = False,
        n_groups: int | None = None,
        topk_groups: int | None = None,
        group_score: GroupScore = "max",
        routed_scale: float = 1.0,
        score_input: bool = False,
        router_norm: bool = False,
        expert_scale: bool = False,
        branch_norms: bool = False,
        norm_eps: float = 1e-6,
        norm_plus_one: bool = False,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        if not 0 < top_k <= n_experts:
            raise ValueError(f"MoE top_k={top_k} must be in [1, n_experts={n_experts}]")
        if impl not in ("dense", "ragged", "dispatch"):
            raise ValueError(f"MoE impl must be 'dense', 'ragged' or 'dispatch', got {impl!r}")
        if kernel not in ("xla", "megablox"):
            raise ValueError(f"MoE kernel must be 'xla' or 'megablox', got {kernel!r}")
        if capacity_factor is not None and (impl != "dispatch" or not capacity_factor > 0):
            raise ValueError(f"MoE capacity_factor={capacity_factor} needs impl='dispatch', > 0")
        clamped = (swiglu_alpha, swiglu_limit)
        if activation == "clamped_swiglu" and None in clamped:
            raise ValueError("MoE activation='clamped_swiglu' needs swiglu_alpha and swiglu_limit")
        if activation != "clamped_swiglu" and clamped != (None, None):
            raise ValueError("MoE swiglu_alpha/swiglu_limit are only read by 'clamped_swiglu'")
        if activation not in ("swiglu", "clamped_swiglu", "relu2", "geglu"):
            raise ValueError(
                f"MoE activation {activation!r}: swiglu, clamped_swiglu, relu2 or geglu"
            )
        if activation == "relu2" and clamped != (None, None):
            raise ValueError("MoE swiglu_alpha/swiglu_limit are only read by 'clamped_swiglu'")
        if branch_norms and shared_d_ff is None:
            raise ValueError("MoE branch_norms needs a shared expert (shared_d_ff)")
        if scoring not in ("softmax", "sigmoid") or group_score not in ("max", "top2_sum"):
            raise ValueError(f"MoE scoring={scoring!r}, group_score={group_score!r} unknown")
        if (n_groups is None) != (topk_groups is None):
            raise ValueError("MoE n_groups and topk_groups are set together")
        if n_groups is not None and (n_experts % n_groups or not 0 < topk_groups <= n_groups):
            raise ValueError(
                f"MoE n_groups={n_groups} must divide n_experts={n_experts} and topk_groups="
                f"{topk_groups} lie in [1, n_groups]"
            )
        kr, kg, ku, kd, ks, kz = jax.random.split(key, 6)
        expert = dict(use_bias=bias, dtype=dtype)
        self.router = Linear(
            d_model, n_experts, axes=(None, "d_model"), use_bias=bias, key=kr, dtype=dtype
        )
        hidden = ("d_ff", "d_model")
        ungated = activation == "relu2"  # the other keys as a gated layer draws them
        self.gate = (
            None
            if ungated
            else ExpertLinear(n_experts, d_model, d_ff, axes=hidden, key=kg, **expert)
        )
        self.up = ExpertLinear(n_experts, d_model, d_ff, axes=hidden, key=ku, **expert)
        self.down = ExpertLinear(
            n_experts, d_ff, d_model, axes=("d_model", "d_ff"), init="residual", key=kd, **expert
        )
        self.shared, self.shared_gate = None, None
        if shared_d_ff is not None:
            if ungated:
                self.shared = MLP(
                    d_model, shared_d_ff, use_bias=False, relu2=True, key=ks, dtype=dtype
                )
            else:
                act = "gelu" if activation == "geglu" else "silu"
                self.shared = GatedMLP(d_model, shared_d_ff, activation=act, key=ks, dtype=dtype)
            if shared_gated:
                self.shared_gate = Linear(d_model, 1, axes=(None, "d_model"), key=kz, dtype=dtype)
        self.score_bias = jnp.zeros(n_experts, jnp.float32) if score_bias else None
        self.top_k, self.normalize, self.impl, self.kernel = top_k, normalize, impl, kernel
        self.capacity_factor = capacity_factor
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, *clamped
        self.scoring, self.n_groups, self.topk_groups = scoring, n_groups, topk_groups
        self.group_score, self.routed_scale = group_score, routed_scale
        self.score_input = score_input
        self.router_scale = jnp.ones(d_model, dtype) if router_norm else None
        self.router_eps = norm_eps if router_norm else None
        self.expert_scale = jnp.ones(n_experts, dtype) if expert_scale else None
        norm = dict(eps=norm_eps, plus_one=norm_plus_one, dtype=dtype)
        norms = [RMSNorm(d_model, **norm) for _ in range(4)]
        self.shared_norm, self.shared_post_norm, self.experts_norm, self.experts_post_norm = (
            norms if branch_norms else [None] * 4
        )

    def _act(self, gate, up):
        """The experts' hidden units from their gate and up projections (gate None: ungated)."""
        if self.activation == "relu2":
            return jnp.square(jax.nn.relu(up))
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(gate, up, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return gated("gelu" if self.activation == "geglu" else "silu", gate, up)

    def _router_input(self, x):
        """x, or with `router_norm` rms_norm(x) * router_scale / sqrt(d_model) (Gemma 4)."""
        if self.router_scale is None:
            return x
        scale = self.router_scale.astype(x.dtype)
        return unit_rms(x, self.router_eps) * scale * x.shape[-1] ** -0.5

    @property
    def n_experts(self) -> int:
        return self.up.weight.shape[-3]  # not the router's: it may be wrapped (LoRA)

    def _hidden(self, project):
        """The experts' hidden units, `project(linear)` giving each of gate (where the experts
        have one) and up on the rows at hand."""
        return self._act(None if self.gate is None else project(self.gate), project(self.up))

    def route(
        self, x: Float[Array, "rows d_model"]
    ) -> tuple[Float[Array, "rows experts"], Float[Array, "rows k"], Int[Array, "rows k"]]:
        """Router logits (compute dtype), the top-k weights (compute dtype) and expert ids."""
        logits = self.router(self._router_input(x))
        if self.plain_routing:
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # fp32, over all experts
            weights, experts = jax.lax.top_k(probs, self.top_k)
            if self.normalize:
                weights = weights / weights.sum(-1, keepdims=True)
        else:
            weights, experts = self._choose(logits.astype(jnp.float32))
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        if self.expert_scale is not None:  # Gemma 4: after renormalising
            weights = weights * self.expert_scale.astype(jnp.float32)[experts]
        return logits, weights.astype(x.dtype), experts

    @property
    def plain_routing(self) -> bool:
        """Softmax over all experts, top k, no bias or groups (every family but DeepSeek)."""
        return self.scoring == "softmax" and self.score_bias is None and self.n_groups is None

    def choices(self, logits: Float[Array, "rows experts"]) -> Int[Array, "rows k"]:
        """The experts each row's router logits choose (as `route` chooses them)."""
        logits = logits.astype(jnp.float32)
        if self.plain_routing:
            return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)[1]
        return self._choose(logits)[1]

    def _choose(self, logits):
        """DeepSeek's selection (`eqllm.nn.moe_choice.limited_choice`): (weights, experts)."""
        return limited_choice(
            logits,
            self.top_k,
            scoring=self.scoring,
            score_bias=self.score_bias,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
            group_score=self.group_score,
            normalize=self.normalize,
        )

    def _dense(self, x, weights, experts, hooks: ExpertHooks | None = None):
        place = placement(hooks)
        # combine[t, e]: token t's weight for expert e, zero unless e is among its top k.
        combine = jnp.einsum(
            "tk,tke->te", weights, jax.nn.one_hot(experts, self.n_experts, dtype=x.dtype)
        )
        combine = place(combine, ("tokens", "expert"))
        every = jnp.broadcast_to(x, (self.n_experts, *x.shape))  # (E, T, d_model)
        if self.score_input:  # each expert reads its weight times x; its output counts whole
            every = every * combine.T[..., None]
            combine = (combine != 0).astype(combine.dtype)
        every = place(every, ("expert", "tokens", "d_model"))
        h = place(self._hidden(lambda linear: linear(every)), ("expert", "tokens", "d_ff"))
        y = place(self.down(h), ("expert", "tokens", "d_model"))  # (E, T, d_model)
        return place(jnp.einsum("etd,te->td", y, combine), ("tokens", "d_model"))

    def _ragged(self, x, weights, experts, kernel):
        rows, k = experts.shape
        flat = experts.reshape(-1)  # (T k,): the expert of each token copy
        order = jnp.argsort(flat, stable=True)  # token copies sorted by expert
        sizes = jnp.bincount(flat, length=self.n_experts)
        copies = x[order // k]  # (T k, d_model)
        if self.score_input:  # each copy scaled by its weight on the way in, not out
            copies = copies * weights.reshape(-1)[order][:, None]
            weights = jnp.ones_like(weights)
        h = self._hidden(lambda linear: linear.grouped(copies, sizes, kernel))
        y = self.down.grouped(h, sizes, kernel)  # (T k, d_model)
        y = jnp.zeros_like(y).at[order].set(y)  # back to token-major order: (T k, d_model)
        return jnp.einsum("tkd,tk->td", y.reshape(rows, k, -1), weights)

    @jax.named_scope("eqllm.MoE")
    def routed(
        self,
        x: Float[Array, "*rows d_model"],
        impl: MoEImpl | None = None,
        hooks: ExpertHooks | None = None,
    ) -> tuple[Float[Array, "*rows d_model"], Routing]:
        """The layer's output and its `Routing` (router logits, expert load, dropped copies).

        `impl` overrides `self.impl`; `hooks`: how a mesh places or dispatches the experts
        (`eqllm.nn.dispatch.ExpertHooks`; None: one device).
        """
        flat = x.reshape(-1, x.shape[-1])  # every leading axis folded into tokens
        logits, weights, experts = self.route(flat)
        impl = impl or self.impl
        dropped = jnp.zeros((), jnp.int32)
        inputs = apply_norm(self.experts_norm, flat)  # the experts' input (the router read flat)
        on_mesh = hooks is not None and hooks.dispatch is not None  # inside shard_map
        kernel = self.kernel
        if hooks is not None and not on_mesh and kernel == "megablox":
            kernel = "xla"  # on a mesh, left to the partitioner, which cannot split a Pallas call
        if impl == "dispatch" or (impl == "ragged" and on_mesh):
            layers, cf = (self.gate, self.up, self.down), self.capacity_factor
            if self.score_input:  # one copy per token: scale it before it is sent
                if self.top_k != 1:
                    raise ValueError(f"MoE score_input with 'dispatch' needs top_k=1: {self.top_k}")
                inputs, weights = inputs * weights, jnp.ones_like(weights)
            out, dropped = dispatched(
                layers, self._act, inputs, weights, experts, cf, kernel, hooks
            )
        elif impl == "dense":
            out = self._dense(inputs, weights, experts, hooks)
        else:
            out = self._ragged(inputs, weights, experts, kernel)
        out = apply_norm(self.experts_post_norm, out)
        if self.shared is not None:
            shared = self.shared(apply_norm(self.shared_norm, flat))
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(self.shared_gate(flat)) * shared
            out = out + apply_norm(self.shared_post_norm, shared)
        logits = logits.reshape(*x.shape[:-1], -1)
        load = jnp.bincount(experts.reshape(-1), length=self.n_experts)
        return out.reshape(x.shape), Routing(logits, load, dropped.astype(jnp.int32))

    def __call__(self, x: Float[Array, "*rows d_model"]) -> Float[Array, "*rows d_model"]:
        return self.routed(x)[0]


__all__ = ["MoE", "Routing", "clamped_swiglu"]
