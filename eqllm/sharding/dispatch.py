"""Expert parallelism by token dispatch over the mesh (`MoE(impl="dispatch")`).

The expert axis is a declared use of `fsdp` (`RULES["expert"]`), as for the dense product's
expert parallelism: the batch is already split over fsdp, so the devices that exchange tokens
are the ones that hold them, each device keeps E / fsdp experts whole (their d_model axis is
not split again, `spec_for`) and no new mesh axis has to be sized, checked and planned. Each
data group of fsdp devices runs its own exchange; the experts are replicated over `data`,
whose gradient sum `shard_map` inserts. Where the rules split the experts' hidden units over
`tensor`, each device runs its slice of every local expert and the down projection's partial
sums are summed over `tensor` (every tensor device sends the same tokens).

`eqllm.sharding.FsdpGather.layer` passes an `ExpertDispatch` to each layer whose experts it
splits (`eqllm.nn.dispatch.ExpertHooks.dispatch`), and keeps those experts' weights split.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import Mesh, PartitionSpec

from eqllm.config.experts import choose_impl, choose_kernel
from eqllm.nn import MoE, param_info
from eqllm.nn.dispatch import dispatch
from eqllm.nn.params import is_param_info
from eqllm.sharding.rules import RULES, AxisSizes, sizes_of, spec_for


def experts_impl(config, backend: str, mesh: AxisSizes) -> tuple[str, str] | None:
    """(how the experts of `config` are computed, why) on `backend` over `mesh` (a Mesh or axis
    sizes): `moe.impl`'s own value, or "auto"'s choice (`eqllm.config.experts.choose_impl`) with
    the size of the mesh axis that splits the experts (`RULES["expert"]`), with or without a
    pipeline. None without experts."""
    moe = config.moe
    if moe is None:
        return None
    shards = sizes_of(mesh)[RULES["expert"]]
    return choose_impl(moe.impl, backend=backend, expert_shards=shards, n_experts=moe.n_experts)


def experts_kernel(config, backend: str, impl: str, mesh: AxisSizes) -> str:
    """The grouped matmul of `config`'s experts computed as `impl` on `backend` over `mesh`
    (`eqllm.config.experts.choose_kernel`: a TPU kernel only where no partitioner splits it)."""
    sizes = sizes_of(mesh)
    return choose_kernel(
        config.moe.kernel,
        backend=backend,
        impl=impl,
        devices=math.prod(sizes.values()),
        expert_shards=sizes[RULES["expert"]],
    )


class ExpertDispatch:
    """`dispatch` on every device of `mesh` inside `shard_map`: the all-to-alls over the
    expert axis, the hidden units' partial sums over the axes that split them, and the dropped
    copies summed over the batch's devices."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.sizes = sizes_of(mesh)
        self.axis = RULES["expert"]
        assert isinstance(self.axis, str), "the expert axis is one mesh axis"
        self.shards = self.sizes[self.axis]
        self.tokens = PartitionSpec(RULES["batch"])
        self.batch_split = math.prod(self.sizes[a] for a in RULES["batch"])

    def splits(self, moe, x) -> bool:
        """Whether the layer `moe`, on the input `x` (*rows, d_model), is dispatched over the
        mesh: impl "dispatch", experts that the expert axis divides, rows that the batch's
        devices divide. Otherwise it runs on one shard's code, placed by the partitioner."""
        if not isinstance(moe, MoE) or moe.impl != "dispatch" or self.shards == 1:
            return False
        rows = x.shape[0] if x.ndim > 2 else x.size // x.shape[-1]
        return moe.n_experts % self.shards == 0 and rows % self.batch_split == 0

    def on_own_rows(self, moe, x) -> bool:
        """Whether the grouped layer `moe` (impl "ragged", or "dispatch" that `splits` declines)
        runs on each device's own rows with every expert whole, gathered over fsdp as the
        other weights are (MaxText's sparse matmul with FSDP): one grouped matmul per device,
        no tokens moved. Left to the partitioner, the grouped matmul's rows are gathered from
        every device (mixtral-8x7b on 256 v6e chips: 105-183 GB of temporaries a chip)."""
        if not isinstance(moe, MoE) or moe.impl not in ("ragged", "dispatch"):
            return False
        if self.splits(moe, x) or (moe.score_input and moe.top_k != 1):
            return False
        rows = x.shape[0] if x.ndim > 2 else x.size // x.shape[-1]
        return rows % self.batch_split == 0

    def own_rows(self, experts, act, x, weights, ids, capacity_factor, kernel):
        """`dispatch` on each device's rows against its gathered experts (`on_own_rows`)."""
        return self(experts, act, x, weights, ids, capacity_factor, kernel, split=False)

    def __call__(self, experts, act, x, weights, ids, capacity_factor, kernel, split=True):
        """`dispatch` inside `shard_map`: the experts split over the expert axis and the tokens
        exchanged (`split`), or every device's experts whole and its rows its own."""
        sizes = self.sizes if split else {**self.sizes, self.axis: 1}
        specs = jax.tree.map(
            lambda info, a: spec_for(info.axes, a.shape, sizes),
            param_info(experts),
            experts,
            is_leaf=is_param_info,
        )
        up = specs[1].weight  # (expert, d_ff, d_model): the axes splitting d_ff, if any
        partial = up[1] if len(up) > 1 else None
        body = functools.partial(
            self._body,
            act=act,
            partial_axis=partial,
            capacity_factor=capacity_factor,
            kernel=kernel,
            split=split,
        )
        tok = self.tokens
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(specs, tok, tok, tok),
            out_specs=(tok, PartitionSpec()),
            # Without the check the transposes are the plain ones (the same values, one more
            # all-reduce where tensor splits the experts). Pallas kernels (megablox) do not say
            # how their outputs vary over the mesh axes, which the check needs; and under the
            # pipeline's vmap over stages (spmd axis `pipeline`), JAX's batching of shard_map
            # marks a value varying over `pipeline` twice and the check refuses it.
            check_vma=kernel != "megablox" and self.sizes["pipeline"] == 1,
        )(experts, x, weights, ids)

    def _body(self, experts, x, weights, ids, *, act, partial_axis, capacity_factor, kernel, split):
        out, dropped = dispatch(
            experts,
            act,
            x,
            weights,
            ids,
            n_shards=self.shards if split else 1,
            axis=self.axis if split else None,
            partial_axis=partial_axis,
            capacity_factor=capacity_factor,
            kernel=kernel,
        )
        return out, jax.lax.psum(dropped, RULES["batch"])
