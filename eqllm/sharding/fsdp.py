"""FSDP (ZeRO-3) during the step: one layer's weights gathered at a time, gradients kept split.

The stacked blocks' arrays live split over `fsdp` (their `d_model` axis, `RULES`). Left alone,
XLA's partitioner gathers every layer's weights once, before the layer loop, so they are whole
on every device for the whole step, and all-reduces whole gradients. `FsdpGather.layer` is the
hook that `eqllm.stack.each_layer` applies inside the loop body: each array of the layer is
constrained first to its fsdp-split placement (so the loop reads one split layer) and then to
the same placement without `fsdp` (the all-gather, inside the body). The gradient of that pair
is asked for split only, so each layer's gradient is reduced over the devices inside the
backward loop body, straight to its split placement (a reduce-scatter; XLA's CPU backend
lowers it as an all-reduce of the one layer and a slice). Without remat, `run_blocks` keeps
everything but the gathered weights for the backward pass, which gathers them again.

Expert parallelism: where the rules split a mixture of experts' weights over fsdp on their
`expert` axis, the experts are computed densely and the layer's tokens are fewer bytes than its
expert weights (`FsdpGather.expert_parallel`), those weights are not gathered. Each device
keeps and runs its own experts: the layer's tokens are all-gathered over fsdp instead (the
[experts, tokens, d_model] input of the expert product placed split over experts and whole over
the fsdp group's tokens), and the combined output, a partial sum over each device's experts, is
reduce-scattered back to the batch split (`eqllm.nn.dispatch.ExpertHooks.place`). Tokens move,
weights stay; each expert's gradient stays on its device (all-reduced over `data` only). A
mixture of experts with `impl="dispatch"` whose experts the mesh splits keeps them split too and
sends each token copy to its expert's device and back (`eqllm.sharding.dispatch`).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqllm.config.kinds import STACKS
from eqllm.model import CausalLM
from eqllm.nn import MoE, param_info
from eqllm.nn.dispatch import ExpertHooks
from eqllm.nn.params import is_param_info
from eqllm.sharding.dispatch import ExpertDispatch
from eqllm.sharding.rules import RULES, sizes_of, spec_for


class FsdpGather:
    """The gathers of one mesh with an fsdp split (see the module docstring).

    `layer(block)` is the hook for `eqllm.stack.each_layer`; what it returns also pins the
    layer's input and output (batch, seq, d_model) to the batch split, so that the split
    weights do not pull the activations, or their gradients, onto a d_model split.
    `outside_layers(model)` gathers the arrays outside the stack (embedding, final norm, head)
    once per step, the way FSDP treats its root module; a tree that is not a `CausalLM` (no
    stack known to loop over) is left to the partitioner.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.sizes = sizes_of(mesh)
        self.batch = NamedSharding(mesh, PartitionSpec(RULES["batch"]))
        self.batch_split = math.prod(self.sizes[a] for a in RULES["batch"])
        self.dispatch = ExpertDispatch(mesh)

    def _constrain(self, info, x, keep_experts=False):
        if not eqx.is_inexact_array(x):
            return x  # dropout keys pass through
        split = spec_for(info.axes, x.shape, self.sizes)
        whole = spec_for(info.axes, x.shape, {**self.sizes, "fsdp": 1})
        if split == whole:
            return x
        if keep_experts and "expert" in info.axes:
            # Expert parallelism: the device's own experts, read split and never gathered.
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, split))
        return _gather(x, NamedSharding(self.mesh, split), NamedSharding(self.mesh, whole))

    def gather(self, tree, keep_experts: bool = False):
        """Every floating-point array of `tree` split by the rules, then gathered over fsdp
        (but for expert weights, when `keep_experts`)."""
        constrain = functools.partial(self._constrain, keep_experts=keep_experts)
        return jax.tree.map(constrain, param_info(tree), tree, is_leaf=is_param_info)

    def expert_parallel(self, block, x) -> bool:
        """Whether `block` runs expert-parallel on the layer input `x` (module docstring): a
        densely computed mixture of experts whose experts the rules split over fsdp, where
        moving the tokens costs fewer bytes than gathering the expert weights. Per layer, in
        the forward and again in the backward pass, expert parallelism all-gathers the fsdp
        group's tokens and reduce-scatters as many outputs (2 x tokens x d_model), FSDP
        gathers three expert matrices (3 x experts x expert d_ff x d_model; two where the
        experts have no gate)."""
        moe = block.mlp
        if not isinstance(moe, MoE) or moe.impl != "dense" or RULES["expert"] != "fsdp":
            return False
        if moe.n_experts % self.sizes["fsdp"]:
            return False
        group_tokens = x.size // x.shape[-1] // self.sizes["data"]
        matrices = 2 if moe.gate is None else 3
        return 2 * group_tokens < matrices * moe.n_experts * moe.up.weight.shape[-2]

    def layer(self, block):
        def run(x, positions, local, segment_ids=None, rotate=None, **inputs):
            parallel = self.expert_parallel(block, x)
            dispatched = self.dispatch.splits(block.mlp, x)
            own_rows = self.dispatch.on_own_rows(block.mlp, x)
            gathered = self.gather(block, keep_experts=parallel or dispatched)
            dispatch = None
            if dispatched and not parallel:
                dispatch = self.dispatch
            elif own_rows:
                dispatch = self.dispatch.own_rows
            experts = ExpertHooks(place=self._place if parallel else None, dispatch=dispatch)
            out, routing = gathered.routed(
                self._pin(x), positions, local, segment_ids, rotate, experts=experts, **inputs
            )  # inputs: a layer's per-layer input, a kv-shared layer's keys and values
            return self._pin(out), routing

        return run

    def _place(self, x, axes):
        """Expert-parallel placement of the dense expert product's arrays: experts over fsdp,
        tokens over data (every device sees its fsdp group's tokens); the product's output
        (no expert axis) back to the batch split."""
        data = self.sizes["data"]
        tokens = ("data",) if "expert" in axes else RULES["batch"]
        rows = x.shape[axes.index("tokens")]
        if rows % (data if "expert" in axes else self.batch_split):
            return x
        # the hidden units stay where the partitioner puts them (split over tensor, say)
        names = {"expert": "fsdp", "tokens": tokens, "d_ff": PartitionSpec.UNCONSTRAINED}
        spec = PartitionSpec(*(names.get(a) for a in axes))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _pin(self, x):
        if x.ndim == 3 and x.shape[0] % self.batch_split == 0:
            x = jax.lax.with_sharding_constraint(x, self.batch)
        return x

    def outside_layers(self, model):
        if not isinstance(model, CausalLM):
            # No stack whose loop gathers layer by layer: the partitioner places the gathers.
            return model
        # every stack is gathered layer by layer, in the loop
        where = lambda m: tuple(getattr(m, f) for f in STACKS.values())  # noqa: E731
        stacks = where(model)
        rest = self.gather(eqx.tree_at(where, model, replace=(None,) * len(STACKS), is_leaf=_none))
        return eqx.tree_at(where, rest, stacks, is_leaf=_none)


def _none(x) -> bool:
    return x is None


def fsdp_gather(mesh: Mesh) -> FsdpGather | None:
    """The per-layer gathers for `mesh`, or None when it has no fsdp split."""
    return FsdpGather(mesh) if sizes_of(mesh).get("fsdp", 1) > 1 else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, split: NamedSharding, whole: NamedSharding):
    """`x` read split over fsdp, then whole over fsdp: an all-gather."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, split), whole)


def _gather_fwd(x, split, whole):
    return _gather(x, split, whole), None


def _gather_bwd(split, whole, _, grad):
    # Only the split placement: the gradient is a sum over the devices' batch rows, and asking
    # for it split lets the partitioner reduce-scatter it. The plain transpose of the gather
    # (the same two constraints) would all-reduce it to whole first, then slice.
    return (jax.lax.with_sharding_constraint(grad, split),)


_gather.defvjp(_gather_fwd, _gather_bwd)
