"""How large the engine's cache and compiled shapes are: the memory budget, the pool of blocks it
holds, and the buckets each shape is drawn from.

Shapes never depend on a request: slot counts, chunk widths and view lengths are buckets fixed
at start-up, so every compiled shape is known up front. The pool is sized by a memory budget,
not by slots x context: a request takes blocks as it grows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.requests import ServeError

MIN_CHUNK = 16  # the narrowest prefill chunk (and prompt bucket)
MULTI_ROW_VIEW = 2048  # longest view (positions) of a prefill call of several prompts
CPU_KV_MEMORY = 4 << 30  # default cache budget on a CPU: at most this...
SCORES_MEMORY = 1 << 28  # one prefill call's fp32 attention scores, at most (chunk_for)
CPU_SHARE, ACCELERATOR_SHARE = 0.5, 0.9  # ... and this share of the free memory


def buckets(first: int, last: int, factor: int = 2) -> list[int]:
    """`first`, `first * factor`, ... below `last`, then `last`: the sizes a shape takes."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return [*sizes, last]


def round_up(n: int, sizes: Sequence[int]) -> int:
    """The smallest of the (ascending) `sizes` that holds `n`."""
    return next(w for w in sizes if w >= n)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The sizes an engine's compiled shapes take, fixed at start-up.

    `view_pages`: the pages a step's views may hold (the last one: `max_len`);
    `multi_row_pages`: the most a prefill call of several prompts may read; `chunks`: prefill
    widths; `prefill_rows[w]`: the row counts of a prefill call `w` wide; `scores`: the widths
    a prompt is scored at; `decode_slots`: the slot counts a decode call runs;
    `decode_steps`: the tokens a decode call may run.
    """

    block_size: int
    view_pages: list[int]
    multi_row_pages: int
    chunks: list[int]
    prefill_rows: dict[int, list[int]]
    scores: list[int]
    decode_slots: list[int]
    decode_steps: list[int]

    @staticmethod
    def make(
        *,
        max_batch: int,
        max_len: int,
        prefill_chunk: int,
        block_size: int,
        decode_steps: int,
        view_lengths: Sequence[int] | None,
        whole_batch: bool,
    ) -> Buckets:
        """The buckets of an engine with these settings (`view_lengths` None: 128, 512, 2048,
        ... up to `max_len`; `whole_batch`: every decode call runs all slots)."""
        max_pages = -(-max_len // block_size)
        lengths = buckets(min(128, max_len), max_len, 4) if view_lengths is None else view_lengths
        view_pages = sorted({-(-n // block_size) for n in lengths} | {max_pages})
        chunks = buckets(MIN_CHUNK, min(prefill_chunk, 1 << (max_len - 1).bit_length()))
        return Buckets(
            block_size=block_size,
            view_pages=view_pages,
            multi_row_pages=round_up(-(-min(max_len, MULTI_ROW_VIEW) // block_size), view_pages),
            chunks=chunks,
            # A prefill call writes a chunk of `width` tokens for each of up to
            # prefill_chunk // width prompts at once (their rows padded to 1, 4, 16, ... of them).
            prefill_rows={w: buckets(1, min(max_batch, prefill_chunk // w), 4) for w in chunks},
            scores=buckets(MIN_CHUNK, 1 << (max_len - 1).bit_length()),
            # A decode call runs the first b slots (b the smallest bucket covering every active
            # slot: one client does not pay for 32 slots).
            decode_slots=[max_batch] if whole_batch else buckets(1, max_batch, 4),
            decode_steps=sorted({1, decode_steps}),
        )

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """Every prefill call's (width, rows, pages)."""
        return [
            (w, r, p)
            for w in self.chunks
            for r in self.prefill_rows[w]
            for p in self.view_pages
            if (r == 1 or p <= self.multi_row_pages) and p * self.block_size >= w
        ]

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """Every decode call's (slots, pages, steps)."""
        return [
            (b, p, k) for b in self.decode_slots for p in self.view_pages for k in self.decode_steps
        ]

    def lines(self, block_size: int, mesh: Mesh | None = None) -> list[str]:
        """Every compiled shape, one line each, positions counted in blocks of `block_size`."""
        on = (
            ""
            if mesh is None
            else " on mesh "
            + ",".join(f"{k}={v}" for k, v in mesh.shape.items() if k in ("data", "tensor"))
        )
        b = block_size
        return (
            [
                f"decode: {s} slots x {p * b} positions x {k} steps{on}"
                for s, p, k in self.decode_shapes()
            ]
            + [
                f"prefill: {r} prompts x {w} tokens over {p * b} positions"
                for w, r, p in self.prefill_shapes()
            ]
            + [f"prompt scoring: {w} tokens" for w in self.scores]
        )


def chunk_for(config, tokens: int, max_len: int) -> int:
    """The prefill chunk that takes `tokens` in one call, a power of two, capped so that one
    call's attention scores (heads x chunk x `max_len` in fp32, each of the softmax's several
    copies) stay within SCORES_MEMORY: an 8,128-token prompt in one call of a 16-head model
    asked for 25.8 GB."""
    whole = 1 << (max(tokens, MIN_CHUNK) - 1).bit_length()
    cap = SCORES_MEMORY // (4 * config.attention.n_heads * max_len)
    return max(MIN_CHUNK, min(whole, 1 << max(cap, 1).bit_length() - 1))


def check_settings(
    config, max_batch: int, max_len: int, prefill_chunk: int, block_size: int, decode_steps: int
) -> None:
    """Raise a ServeError naming the first engine setting out of its range."""
    if not 1 <= max_batch <= 4096:
        raise ServeError(f"max_batch={max_batch} must be between 1 and 4096")
    if not 2 <= max_len <= config.max_seq_len:
        raise ServeError(
            f"max_len={max_len} must be between 2 and the model's context "
            f"max_seq_len={config.max_seq_len}"
        )
    if prefill_chunk < MIN_CHUNK or prefill_chunk & (prefill_chunk - 1):
        raise ServeError(f"prefill_chunk={prefill_chunk} must be a power of two >= 16")
    if block_size < 1 or block_size & (block_size - 1):
        raise ServeError(f"block_size={block_size} must be a power of two")
    if decode_steps < 1:
        raise ServeError(f"decode_steps={decode_steps} must be at least 1")


def request_bytes(model, length: int, block_size: int = 16) -> int:
    """Cache bytes one request of `length` positions holds in an engine: its blocks of every
    attention layer's pool (whole blocks of `block_size`) and, in a hybrid, its slot's
    recurrent state, which does not grow with the length. `model` may be a shape-only skeleton
    (`eqx.filter_eval_shape(CausalLM, config, key=...)`): only its config is read."""
    blocks = -(-length // block_size)
    return blocks * block_size * bytes_per_token(model) + state_bytes(model)


def free_memory(device=None) -> tuple[int, bool]:
    """(bytes free on `device`, whether it is an accelerator): the allocator's limit less what
    it holds on a GPU or TPU; the kernel's MemAvailable on a CPU."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), True
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, False
    except (OSError, KeyError, ValueError):  # not Linux: assume the CPU default fits
        return 2 * CPU_KV_MEMORY, False


def default_kv_memory(device=None) -> int:
    """The cache budget when none is given: 90% of an accelerator's free memory; on a CPU half
    the available memory, at most 4 GiB (the host runs everything else too)."""
    free, accelerator = free_memory(device)
    if accelerator:
        return int(free * ACCELERATOR_SHARE)
    return int(min(free * CPU_SHARE, CPU_KV_MEMORY))


def pool_blocks(
    blocks: int | None,
    memory: int | None,
    *,
    block_bytes: int,
    block_size: int,
    max_batch: int,
    max_len: int,
    mesh: Mesh | None,
    slot_bytes: int = 0,
) -> int:
    """Blocks in the pool: `blocks`, or as many as the budget `memory` holds (None:
    `default_kv_memory()`; never more than every slot at full length needs) after every slot's
    fixed-size state (`slot_bytes` each: a hybrid's recurrent state), split evenly over the
    data replicas; refused when one request at `max_len` would not fit. A model without
    attention layers (`block_bytes` 0: Mamba-2 alone) gets every slot's pages at full length,
    which hold no bytes, once the budget holds every slot's state."""
    max_pages = -(-max_len // block_size)
    data = 1 if mesh is None else mesh.shape["data"]
    if blocks is None and block_bytes == 0:
        budget = default_kv_memory() if memory is None else memory
        if mesh is not None:
            budget *= mesh.size
        if budget < max_batch * slot_bytes:
            raise ServeError(
                f"the cache budget of {budget / 2**30:.2f} GiB holds less than the recurrent "
                f"state of max_batch={max_batch} slots ({max_batch * slot_bytes / 2**30:.2f} "
                "GiB); lower max_batch (--max-batch) or raise the budget (--kv-cache-memory)"
            )
        blocks = max_batch * max_pages
    elif blocks is None:
        budget = default_kv_memory() if memory is None else memory
        if mesh is not None:  # each device holds its share of the pool
            budget *= mesh.size
        budget = max(budget - max_batch * slot_bytes, 0)
        blocks = min(budget // block_bytes, max_batch * max_pages)
        if blocks < max_pages:
            raise ServeError(
                f"the KV cache budget of {budget / 2**30:.2f} GiB holds "
                f"{blocks * block_size} positions, fewer than one request of "
                f"max_len={max_len} needs ({max_pages * block_bytes / 2**30:.2f} "
                "GiB); lower max_len (--max-len) or raise the budget (--kv-cache-memory)"
            )
    elif blocks < max_pages:
        raise ServeError(
            f"kv_blocks={blocks} holds fewer positions than one request of "
            f"max_len={max_len} needs ({max_pages} blocks of {block_size})"
        )
    return -(-blocks // data) * data
