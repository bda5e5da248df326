"""The paged cache on the device, and the model's forward over it.

Every attention layer's cache is a paged pool (`Pool`): the arrays of the layer's cache kind
(`KVCache`: keys and values; `LatentCache`: DeepSeek's latents and rotary keys) with one row per
token position of the pool, `blocks x block_size` rows in all, shared by every slot. A slot's
page table (kept on the host, `eqllm.generation.pages`, and passed to each call) says which
blocks hold its positions. `forward` runs the model's own cached layer calls
(`CausalLM.cached_calls`) one layer at a time: it gathers, for each of its rows, a view of the
blocks the layer needs into the layer's own cache kind, runs the layer on the views (unchanged
layer code: a view is a cache like any other), and writes the positions it computed back into
the pool, and nothing else. So a step holds one layer's views at a time.

A view holds `m` blocks as a ring: block j of the sequence sits at ring place j % m, so position
p is at p % (m x block_size), the convention of a ring cache. A global layer's view holds every
block up to the step's last position (m = the step's pages); a sliding-window layer's only the
blocks its window can reach from the step's positions, so decoding reads the window, not the
sequence.

A recurrent layer (a hybrid's linear-attention layer, a Mamba-2 layer) has no pool: its entry
of the cache is the recurrent state of the call's rows (`eqllm.generation.recurrent`), which the
layer continues and `forward` returns. A layer with a mixer beside attention (Falcon-H1's) has
the pair (its pool, its mixer's state): the layer runs on (its view, the state). A kv-shared
layer (`attention.kv_shared_layers`) has no pool: it runs on its source layer's view and the
keys and values the source computed for the step (`eqllm.stack.run.layer_extra`). A stack of
Mamba-2 layers alone has no pool at all: its pages and page tables are bookkeeping that holds
no bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqllm.config import ModelConfig
from eqllm.config.per_layer import kv_sources
from eqllm.errors import EqllmError
from eqllm.generation.adapters import has_adapters, row_calls
from eqllm.generation.recurrent import State, is_state, parts
from eqllm.model import CausalLM
from eqllm.nn import KVCache, LatentCache
from eqllm.nn.linear import zero_after
from eqllm.stack.run import layer_extra


class Pool(eqx.Module):
    """One layer's paged cache: the data arrays of a cache kind (every field but `positions`),
    each with one row per token position of the pool."""

    data: dict[str, Array]
    kind: type = eqx.field(static=True)
    treedef: jax.tree_util.PyTreeDef = eqx.field(static=True)

    @staticmethod
    def empty(template: KVCache | LatentCache, rows: int) -> Pool:
        """`rows` zero rows shaped like one position of `template` (a cache of any length)."""
        kind = type(template)
        data = {}
        for name in data_fields(kind):
            leaf = getattr(template, name)
            data[name] = jnp.zeros((rows, *leaf.shape[1:]), leaf.dtype)
        return Pool(data, kind, jax.tree.structure(template))

    @property
    def rows(self) -> int:
        return next(iter(self.data.values())).shape[0]

    def view(self, data: dict[str, Array], positions: Array):
        """A cache of this pool's kind from per-row arrays (built from its leaves: the kind's
        constructor checks the shapes of one sequence's cache)."""
        fields = [f.name for f in dataclasses.fields(self.kind)]
        leaves = [positions if name == "positions" else data[name] for name in fields]
        return jax.tree.unflatten(self.treedef, leaves)


# A layer's entry of the engine's cache: its pool, its rows' recurrent state, or both.
Entry = Pool | State | tuple[Pool, State]


def data_fields(kind: type) -> list[str]:
    """The arrays a cache kind holds per position (its fields but `positions`)."""
    return [f.name for f in dataclasses.fields(kind) if f.name != "positions"]


def bytes_per_token(model: CausalLM) -> int:
    """Cache bytes one token position takes in all of the model's pools."""
    return sum(
        math.prod(getattr(c, name).shape[1:]) * getattr(c, name).dtype.itemsize
        for entry in model.init_cache(1)
        for c in parts(entry)
        if not is_state(c)  # a fixed size per sequence, not per token
        for name in data_fields(type(c))
    )


def state_bytes(model: CausalLM) -> int:
    """Bytes of recurrent state one sequence holds in all of the model's recurrent layers
    (Gated DeltaNet, Mamba-2), whatever its length (0 without any)."""
    return sum(
        math.prod(a.shape) * a.dtype.itemsize
        for entry in model.init_cache(1)
        for c in parts(entry)
        if is_state(c)
        for a in jax.tree.leaves(c)
    )


def windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: it attends to everything)."""
    window = config.attention.sliding_window or config.attention.chunk_size  # a chunk: a ring
    return tuple(window if local else None for local in config.local_layers())


def view_blocks(window: int | None, pages: int, new: int, block_size: int) -> int:
    """Blocks in a layer's view: all `pages` for a global layer; for a window, those that
    positions [start - window + 1, start + new) can touch, at most."""
    if window is None:
        return pages
    return min(pages, -(-(window - 1 + new) // block_size) + 1)


def _view(
    pool: Pool,
    pages: Int[Array, "rows pages"],
    start: Int[Array, " rows"],
    end: Int[Array, " rows"],
    blocks: int,
    block_size: int,
    after: Int[Array, ""],
):
    """Each row's view of `pool`: `blocks` blocks as a ring, the last one holding position
    end - 1; positions at or after `start` (not cached yet) and before 0 are marked empty.
    `after` is a zero the reads are made to depend on (see `forward`)."""
    rows, n_pages = pages.shape
    last = (jnp.maximum(end, 1) - 1) // block_size
    place = jnp.arange(blocks)
    block = last[:, None] - (last[:, None] - place) % blocks  # block j sits at place j % blocks
    ids = jnp.take_along_axis(pages, jnp.clip(block, 0, n_pages - 1), axis=1)
    offset = jnp.arange(block_size)
    index = (ids[:, :, None] * block_size + offset).reshape(rows, -1) + after
    position = (block[:, :, None] * block_size + offset).reshape(rows, -1)
    position = jnp.where((position >= 0) & (position < start[:, None]), position, -1)
    data = {name: leaf[index] for name, leaf in pool.data.items()}
    return pool.view(data, position.astype(jnp.int32))


def _write(
    pool: Pool,
    view,
    pages: Int[Array, "rows pages"],
    positions: Int[Array, "rows new"],
    block_size: int,
) -> Pool:
    """`pool` with the view entries at `positions` (negative: none) written to their blocks."""
    rows, n_pages = pages.shape
    ring = view.positions.shape[1]
    ids = jnp.take_along_axis(pages, jnp.clip(positions // block_size, 0, n_pages - 1), axis=1)
    index = jnp.where(positions >= 0, ids * block_size + positions % block_size, pool.rows)
    source = jnp.maximum(positions, 0) % ring
    row = jnp.arange(rows)[:, None]
    data = {
        name: leaf.at[index].set(getattr(view, name)[row, source], mode="drop")
        for name, leaf in pool.data.items()
    }
    return Pool(data, pool.kind, pool.treedef)


def forward(
    fixed,
    cache: tuple[Entry, ...],
    pages: Int[Array, "rows pages"],
    tokens: Int[Array, "rows new"],
    positions: Int[Array, "rows new"],
    start: Int[Array, " rows"],
    block_size: int,
    adapter: Int[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows vocab"], tuple[Entry, ...]]:
    """`forward_hidden`, and the logits after each row's last position."""
    x, written = forward_hidden(fixed, cache, pages, tokens, positions, start, block_size, adapter)
    return jax.vmap(fixed[0].next_logits)(x), written


def forward_hidden(
    fixed,
    cache: tuple[Entry, ...],
    pages: Int[Array, "rows pages"],
    tokens: Int[Array, "rows new"],
    positions: Int[Array, "rows new"],
    start: Int[Array, " rows"],
    block_size: int,
    adapter: Int[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows new d_model"], tuple[Entry, ...]]:
    """The model's own cached forward on each row's new positions (negative: padding), one
    layer at a time: a layer's views are gathered from its pool right before it runs, and the
    positions it computed written back right after; the last layer's output at every position
    (before the final norm). `adapter` is each row's LoRA adapter (`eqllm.generation.adapters`).

    The order is held by data: a layer's write, and the next layer's reads, depend on the
    layer's output through a zero XLA cannot see is zero (an argmax is >= 0). Left to itself
    XLA gathered every layer's views first, so rows x view positions x every layer were alive
    at once (22.7 GiB for a decode of 32 slots over 8,192 positions of smollm2-135m, whose
    default pool is 4 GiB; 0.9 GiB so ordered); and it may move a write before the reads of
    its pool, and copy the whole pool to keep them apart. (Optimization barriers do not hold
    it: XLA's CPU pipeline removes them before it schedules.)
    """
    model, layers = fixed
    n_pages, new = pages.shape[1], tokens.shape[1]
    end = start + jnp.sum(positions >= 0, axis=1)
    x = jax.vmap(model.embed_inputs)(tokens, positions)
    inputs = model.per_layer_inputs(tokens, x)  # (layers, rows, new, d); None without
    if adapter is not None and kv_sources(model.config) and has_adapters(layers):
        raise EqllmError(
            f"attention.kv_shared_layers={model.config.attention.kv_shared_layers}: serving "
            "several adapters over kv-shared layers is not supported yet (the sources' keys "
            "would miss each row's adapter); merge the adapter (eqllm convert --merge)"
        )
    after = jnp.zeros((), jnp.int32)
    written, shared = [], {}
    calls = row_calls(model, layers, adapter)  # vmapped over rows
    for i, (call, entry, window) in enumerate(
        zip(calls, cache, windows(model.config), strict=True)
    ):
        blocks = view_blocks(window, n_pages, new, block_size)
        read = functools.partial(
            _view,
            pages=pages,
            start=start,
            end=end,
            blocks=blocks,
            block_size=block_size,
            after=after,
        )
        view = _on_pools(read, entry)  # a state: the rows' own
        # a kv-shared layer (no pool: entry None) attends to its source's view and chunk
        extra = layer_extra(model.config, i, layers, x, positions, view, inputs, shared)
        x, out = call(x, positions, view, **extra)
        after = zero_after(x)
        write = functools.partial(
            _write, pages=pages, positions=positions + after, block_size=block_size
        )
        written.append(_on_pools(write, entry, out))
    return x, tuple(written)


def _on_pools(fn, entry, *out):
    """`fn(pool, *out)` for each pool of a layer's entry (alone or in a pair); a recurrent state
    is the rows' state to continue: as it is, or (with `out`, the call's output) the call's."""
    if isinstance(entry, tuple):
        return tuple(_on_pools(fn, e, *o) for e, *o in zip(entry, *out, strict=True))
    if is_state(entry):
        return out[0] if out else entry
    return fn(entry, *out)
