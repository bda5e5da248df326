"""Expert parallelism by token dispatch: `MoE(impl="dispatch")`.

The experts are split over a mesh axis (`eqllm.sharding` uses `fsdp`): `n_shards` shards of
`local` experts each, expert e on shard e // local. Each shard routes its own tokens (the
routing is `MoE.route`'s, before the dispatch), sorts the token copies by expert and sends
each copy to the shard that holds its expert with one all-to-all; there the received copies
are sorted by local expert and run through the local experts as one grouped matmul
(`jax.lax.ragged_dot`); a second all-to-all brings the outputs home, where each token sums
its k outputs with its routing weights. Weights never move: only tokens and their gradients.

All-to-all moves fixed-size blocks, so each shard sends every other shard a block of `slot`
rows. Dropless (the default), a slot holds all of a shard's n = tokens x k copies, which is
the worst case (every copy to one shard): the send and receive buffers and the grouped matmul
hold n_shards x n rows where n are useful (n_shards times the memory and all-to-all bytes of a
perfectly balanced exchange). With a capacity factor c a slot holds ceil(c x n / n_shards)
rows; copies past that are dropped (they add nothing to their token's output, as in the
Switch Transformer) and counted.

The dense product's own expert parallelism lives here too: an `ExpertHooks` holds both, the
dense product's placement (`place`) and the dispatcher (`dispatch`), and a caller who knows the
mesh passes it to the layer's call (`Block.routed(..., experts=hooks)`, `MoE.routed`), so that
`eqllm.nn` knows no devices. The FSDP layer hook (`eqllm.sharding.FsdpGather.layer`) builds it
per layer; it changes where the arrays are placed, never their values.

Without a dispatcher (one device, or a mesh that does not split the experts) the same
computation runs with one shard and no exchange: a grouped matmul over the sorted copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqllm.nn.linear import ExpertLinear

# (array, logical axes of its dimensions) -> the same values, placed (see `ExpertHooks`).
ExpertPlacement = Callable[[Array, tuple[str, ...]], Array]
# gate (None: ungated experts), up, down
Experts = tuple[ExpertLinear | None, ExpertLinear, ExpertLinear]
Activation = Callable[[Array | None, Array], Array]
# (experts, activation, rows, weights, expert ids, capacity factor, grouped-matmul kernel)
# -> (output, dropped copies)
Dispatcher = Callable[..., tuple[Array, Array]]


class ExpertHooks(NamedTuple):
    """How a mesh runs one mixture-of-experts layer, passed to its call by a caller that knows
    the mesh (`eqllm.sharding.FsdpGather`); None fields leave the one-device computation.

    `place(array, axes)`: the dense expert product passes the tokens it gives every expert
    ("expert", "tokens", "d_model"), the experts' hidden units ("expert", "tokens", "d_ff") and
    outputs ("expert", "tokens", "d_model"), the combine weights ("tokens", "expert") and the
    combined output ("tokens", "d_model") through it and uses what it returns (the same values:
    a sharding constraint, say, which also places their gradients).
    `dispatch(experts, act, x, weights, ids, capacity_factor, kernel)`: `MoE(impl="dispatch")`
    computes its routed experts with it in place of `dispatch` on one shard (the caller runs
    `dispatch` on every shard of the mesh, `shard_map`, with the all-to-alls over the experts'
    mesh axis).
    """

    place: ExpertPlacement | None = None
    dispatch: Dispatcher | None = None


def placement(hooks: ExpertHooks | None) -> ExpertPlacement:
    """The dense product's placement of `hooks`; without one, the identity."""
    return (hooks and hooks.place) or (lambda x, axes: x)


def dispatched(
    experts: Experts,
    act: Activation,
    x,
    weights,
    ids,
    capacity_factor: float | None = None,
    kernel: str = "xla",
    hooks: ExpertHooks | None = None,
) -> tuple[Float[Array, "rows d_model"], Int[Array, ""]]:
    """The routed experts' combined output and the number of dropped copies, through the
    dispatcher of `hooks`, else on one shard; `kernel`: the grouped matmul
    (`eqllm.nn.ExpertLinear.grouped`)."""
    if hooks is None or hooks.dispatch is None:
        one = dict(n_shards=1, capacity_factor=capacity_factor, kernel=kernel)
        return dispatch(experts, act, x, weights, ids, **one)
    return hooks.dispatch(experts, act, x, weights, ids, capacity_factor, kernel)


def slot_rows(rows: int, k: int, local: int, n_shards: int, capacity_factor: float | None) -> int:
    """Rows one shard sends another: the most it can ever send (dropless), or its fair share
    of its copies times the capacity factor, rounded up (never more than the most).

    A row's k copies go to k different experts, so at most min(k, local) of them to one shard:
    dropless needs rows * min(k, local) per destination, n_shards * min(k, local) / k times
    the copies in all (min(n_shards, experts / k): DeepSeek-V3's 256 experts, top 8, over 128
    shards: 32x), where a fair share needs 1x."""
    most = rows * min(k, local)
    if capacity_factor is None:
        return most
    return min(most, max(1, math.ceil(capacity_factor * rows * k / n_shards)))


def dispatch(
    experts: Experts,
    act: Activation,
    x: Float[Array, "rows d_model"],
    weights: Float[Array, "rows k"],
    ids: Int[Array, "rows k"],
    *,
    n_shards: int,
    axis: str | None = None,
    partial_axis: str | None = None,
    capacity_factor: float | None = None,
    kernel: str = "xla",
) -> tuple[Float[Array, "rows d_model"], Int[Array, ""]]:
    """One shard's part of the dispatch (module docstring): its rows and their routing in,
    their combined expert outputs and its dropped copies out.

    Arguments:
        experts: this shard's experts (gate, up, down), `local` of them on the leading axis;
            gate None for ungated experts.
        act: the experts' activation, act(gate(x), up(x)) (act(None, up(x)) without a gate).
        x, weights, ids: this shard's rows, their top-k routing weights and expert ids (ids
            count every shard's experts: expert e is local expert e % local of shard e // local).
        n_shards: shards over `axis` (1 without an axis: no exchange).
        axis: the mesh axis the experts are split over (inside `shard_map`).
        partial_axis: a mesh axis over which the experts' hidden units are split (tensor
            parallelism): each shard's down projection is then a partial sum, summed over it.
        capacity_factor: None for dropless, else the slot size's multiple of a fair share.
        kernel: the grouped matmul (`eqllm.nn.ExpertLinear.grouped`).
    """
    gate, up, down = experts
    local = up.weight.shape[0]
    rows, k = ids.shape
    copies, d_model = rows * k, x.shape[-1]
    slot = slot_rows(rows, k, local, n_shards, capacity_factor)

    # Sender: copies sorted by expert, so each destination's copies are one contiguous run.
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    dest = flat[order] // local  # (copies,), non-decreasing
    counts = jnp.bincount(flat, length=local * n_shards).reshape(n_shards, local)
    per_dest = counts.sum(1)
    pos = jnp.arange(copies) - (jnp.cumsum(per_dest) - per_dest)[dest]  # rank in its slot
    # Within a slot the copies are sorted by expert: the first `slot` of them are kept.
    before = jnp.cumsum(counts, axis=1) - counts
    kept = jnp.clip(slot - before, 0, counts)  # (n_shards, local)
    send = jnp.zeros((n_shards, slot, d_model), x.dtype)
    send = send.at[dest, pos].set(x[order // k], mode="drop")  # copies past the slot: dropped
    recv, recv_counts = _exchange(send, axis), _exchange(kept, axis)  # [source, ...]

    # Receiver: each source's block holds its copies sorted by local expert, then padding;
    # sort all of them by local expert (padding, key `local`, last) for one grouped matmul.
    ends = jnp.cumsum(recv_counts, axis=1)  # (n_shards, local)
    slots = jnp.arange(slot)
    local_ids = jax.vmap(lambda e: jnp.searchsorted(e, slots, side="right"))(ends)
    by_expert = jnp.argsort(local_ids.reshape(-1), stable=True)
    sizes = recv_counts.sum(0)  # (local,): rows per local expert; the rest is padding
    h_in = recv.reshape(-1, d_model)[by_expert]
    gated = None if gate is None else gate.grouped(h_in, sizes, kernel)
    h = act(gated, up.grouped(h_in, sizes, kernel))
    unbiased = eqx.tree_at(lambda m: m.bias, down, None, is_leaf=lambda b: b is None)
    y = unbiased.grouped(h, sizes, kernel)
    if partial_axis is not None:
        y = jax.lax.psum(y, partial_axis)
    if down.bias is not None:  # added once, after the partial sums
        y = y + jnp.repeat(down.bias, sizes, axis=0, total_repeat_length=y.shape[0])
    y = jnp.zeros_like(y).at[by_expert].set(y).reshape(n_shards, slot, d_model)

    # Home again: the output of the copy sent to [dest, pos] comes back to [dest, pos].
    back = _exchange(y, axis)
    out = back.at[dest, pos].get(mode="fill", fill_value=0)  # a dropped copy adds nothing
    out = jnp.zeros_like(out).at[order].set(out).reshape(rows, k, d_model)
    dropped = copies - kept.sum()
    return jnp.einsum("tkd,tk->td", out, weights), dropped


def _exchange(blocks: Array, axis: str | None) -> Array:
    """blocks[j] goes to shard j; the result's [i] came from shard i (no axis: one shard)."""
    if axis is None:
        return blocks
    return jax.lax.all_to_all(blocks, axis, split_axis=0, concat_axis=0)
