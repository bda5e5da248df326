"""The continuous-batching engine: every generation in eqllm runs on it.

`eqllm.generate`, `generate_batch` and `stream` make an engine for their prompts; `eqllm serve`
keeps one for its lifetime; evaluation samples, the lm-evaluation-harness backend and GRPO
rollouts go through `generate_batch`. One cache layout, one sampler, one way a sequence joins
and leaves.

A request waits in a bounded queue until a slot is free. On joining it looks its prompt's full
blocks up in the prefix cache (`eqllm.generation.pages`) and starts after the blocks found.
Between two decode steps of the running requests, up to `prefill_chunk` prompt tokens are
written into the cache (one long prompt's chunk, or several short prompts in one call; while
no request decodes, every prompt that has a slot goes in at once), so prompts never stall the
running requests for more than a chunk. Once prefilled, a request joins the batch the decode
step runs; it leaves when it stops (a stop token, `max_tokens`, the context, or a cancel) and
gives its blocks back (full ones stay cached for reuse until evicted).

The cache is a pool of blocks sized by a memory budget, not by slots x context: a request takes
blocks as it grows. When the pool runs short, the most recently admitted request is preempted:
its blocks go back (cached, so that it may find them again) and it waits at the head of the
queue to be computed again, drawing the tokens it would have drawn.

Shapes never depend on a request: slot counts, chunk widths and view lengths are buckets fixed
at start-up, so every compiled shape is known up front (`Engine.shapes`) and `Engine.warm`
compiles them all before serving (an engine made for one batch, as `generate_batch` makes,
compiles what it meets instead). The engine runs in its own thread when started; results reach
each request through the callback it was submitted with.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqllm.generation.pages import BlockPool, block_hashes
from eqllm.generation.placement import check_mesh, state_shardings
from eqllm.generation.requests import (
    Finished,
    Params,
    PromptScores,
    QueueFull,
    Request,
    ServeError,
    Token,
)
from eqllm.generation.sampling import GenerationError, sampling
from eqllm.generation.settings import RowSettings
from eqllm.generation.steps import NO_TOKEN, TRACES, bytes_per_token, compiled, empty_state
from eqllm.hostmem import release_free_memory
from eqllm.model import CausalLM

log = logging.getLogger("eqllm.serve")

MIN_CHUNK = 16  # the narrowest prefill chunk (and prompt bucket)
MAX_STOPS = 8  # stop ids the decode loop checks on device (the host checks every one)
MULTI_ROW_VIEW = 2048  # longest view (positions) of a prefill call of several prompts
CPU_KV_MEMORY = 4 << 30  # default cache budget on a CPU: at most this...
CPU_SHARE, ACCELERATOR_SHARE = 0.5, 0.9  # ... and this share of the free memory


def buckets(first: int, last: int, factor: int = 2) -> list[int]:
    """`first`, `first * factor`, ... below `last`, then `last`: the sizes a shape takes."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return [*sizes, last]


def _bucket(n: int, widths: Sequence[int]) -> int:
    return next(w for w in widths if w >= n)


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


class Engine:
    """Generate for many requests at once from one model.

    Arguments:
        model: the language model (any family, any dtype, quantized or not).
        max_batch: slots, i.e. requests decoded together.
        max_len: positions per request (prompt + output); at most the model's context (None:
            the context).
        prefill_chunk: prompt tokens prefilled per round (between two decode steps), a power
            of two >= 16: one prompt's chunk of up to that many, or chunks of several prompts.
        max_queue: requests allowed to wait for a slot; more raise QueueFull.
        mesh: a device mesh (`eqllm.generation.placement.serving_mesh`) to split the weights and
            the cache over `tensor` and the slots over `data`; None: one device.
        block_size: positions per cache block.
        kv_blocks: blocks in the cache pool (None: as many as `kv_memory` holds, at most enough
            for every slot at `max_len`).
        kv_memory: the cache's budget in bytes (None: `default_kv_memory()`).
        prefix_cache: reuse the cached blocks of equal prompt prefixes.
        decode_steps: tokens a decode call runs on device while no prompt waits to be prefilled
            (1: a new request joins after at most one token of the others).
        view_lengths: the cache positions a step may read, as buckets (None: 128, 512, 2048, ...
            up to `max_len`, so one request does not pay for the whole context).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        max_batch: int = 32,
        max_len: int | None = None,
        prefill_chunk: int = 128,
        max_queue: int = 256,
        mesh: Mesh | None = None,
        block_size: int = 16,
        kv_blocks: int | None = None,
        kv_memory: int | None = None,
        prefix_cache: bool = True,
        decode_steps: int = 1,
        view_lengths: Sequence[int] | None = None,
    ):
        cfg = model.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_batch <= 4096:
            raise ServeError(f"max_batch={max_batch} must be between 1 and 4096")
        if not 2 <= max_len <= cfg.max_seq_len:
            raise ServeError(
                f"max_len={max_len} must be between 2 and the model's context "
                f"max_seq_len={cfg.max_seq_len}"
            )
        if prefill_chunk < MIN_CHUNK or prefill_chunk & (prefill_chunk - 1):
            raise ServeError(f"prefill_chunk={prefill_chunk} must be a power of two >= 16")
        if block_size < 1 or block_size & (block_size - 1):
            raise ServeError(f"block_size={block_size} must be a power of two")
        if decode_steps < 1:
            raise ServeError(f"decode_steps={decode_steps} must be at least 1")
        if mesh is not None:
            check_mesh(cfg, mesh, max_batch)
        self.config, self.mesh = cfg, mesh
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.prefill_chunk, self.block_size, self.decode_steps = (
            prefill_chunk,
            block_size,
            decode_steps,
        )
        self.max_pages = -(-max_len // block_size)
        self.kv_blocks = self._pool_blocks(model, kv_blocks, kv_memory)
        self.kv_bytes = self.kv_blocks * block_size * bytes_per_token(model)
        lengths = buckets(min(128, max_len), max_len, 4) if view_lengths is None else view_lengths
        self.view_pages = sorted({-(-n // block_size) for n in lengths} | {self.max_pages})
        self.multi_row_pages = _bucket(
            -(-min(max_len, MULTI_ROW_VIEW) // block_size), self.view_pages
        )
        self.chunks = buckets(MIN_CHUNK, min(prefill_chunk, 1 << (max_len - 1).bit_length()))
        self.scores = buckets(MIN_CHUNK, 1 << (max_len - 1).bit_length())
        # A prefill call writes a chunk of `width` tokens for each of up to prefill_chunk // width
        # prompts at once (their rows padded to 1, 4, 16, ... of them).
        self.prefill_rows = {
            w: buckets(1, min(max_batch, prefill_chunk // w), 4) for w in self.chunks
        }
        # A decode step runs the first b slots (b the smallest bucket covering every active
        # slot: one client does not pay for 32 slots). Slots split over `data` replicas always
        # run whole, so that each replica keeps its share.
        split = mesh is not None and mesh.shape["data"] > 1
        self.decode_slots = [max_batch] if split else buckets(1, max_batch, 4)
        self.traces: dict[str, int] = {}
        # The weights the steps run on, as placed: (model without its blocks, sliced layers).
        self._steps, self.weights = compiled(model, mesh)
        self._steps = {name: self._counted(name, fn) for name, fn in self._steps.items()}
        self.pool = BlockPool(self.kv_blocks, block_size, prefix_cache=prefix_cache)
        self._state = empty_state(model, max_batch, self.kv_blocks, block_size)
        if mesh is not None:
            self._state = jax.device_put(self._state, state_shardings(self._state, mesh))
        self._slots: list[Request | None] = [None] * max_batch
        self._settings = RowSettings(max_batch)  # each slot's sampling settings
        self._stops = np.full((max_batch, MAX_STOPS), -1, np.int32)
        self._admitted = itertools.count()
        self.cancelled = 0  # requests stopped by a cancel (a client that went away)
        self.preempted = 0  # times a request gave its blocks back to let others run
        self._waiting: deque[Request] = deque()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    def _pool_blocks(self, model: CausalLM, blocks: int | None, memory: int | None) -> int:
        """Blocks in the pool: given, or as many as the budget holds (never more than every
        slot at full length needs); refused when one request at `max_len` would not fit."""
        per_block = self.block_size * bytes_per_token(model)
        data = 1 if self.mesh is None else self.mesh.shape["data"]
        if blocks is None:
            budget = default_kv_memory() if memory is None else memory
            if self.mesh is not None:  # each device holds its share of the pool
                budget *= self.mesh.size
            blocks = min(budget // per_block, self.max_batch * self.max_pages)
            if blocks < self.max_pages:
                raise ServeError(
                    f"the KV cache budget of {budget / 2**30:.2f} GiB holds "
                    f"{blocks * self.block_size} positions, fewer than one request of "
                    f"max_len={self.max_len} needs ({self.max_pages * per_block / 2**30:.2f} "
                    "GiB); lower max_len (--max-len) or raise the budget (--kv-cache-memory)"
                )
        elif blocks < self.max_pages:
            raise ServeError(
                f"kv_blocks={blocks} holds fewer positions than one request of "
                f"max_len={self.max_len} needs ({self.max_pages} blocks of {self.block_size})"
            )
        return -(-blocks // data) * data  # split evenly over the data replicas

    def _counted(self, name: str, fn):
        def call(*args, **sizes):
            before = TRACES.get(name, 0)
            out = fn(*args, **sizes)
            if TRACES.get(name, 0) != before:
                self.traces[name] = self.traces.get(name, 0) + TRACES[name] - before
            return out

        return call

    # Shapes and warm-up -------------------------------------------------------------------------

    def describe(self) -> str:
        """One line on the cache: blocks, positions and bytes reserved."""
        positions = self.kv_blocks * self.block_size
        return (
            f"KV cache: {self.kv_blocks:,} blocks of {self.block_size} positions = "
            f"{positions:,} positions ({positions / self.max_len:.1f} x max_len={self.max_len:,}), "
            f"{self.kv_bytes / 2**30:.2f} GiB reserved; {self.max_batch} slots"
            + ("" if self.pool.prefix_cache else "; prefix cache off")
        )

    def shapes(self) -> list[str]:
        """Every compiled shape the engine uses, one line each."""
        on = (
            ""
            if self.mesh is None
            else " on mesh "
            + ",".join(f"{k}={v}" for k, v in self.mesh.shape.items() if k in ("data", "tensor"))
        )
        b = self.block_size
        return (
            [
                f"decode: {s} slots x {p * b} positions x {k} steps{on}"
                for s, p, k in self._decode_shapes()
            ]
            + [
                f"prefill: {r} prompts x {w} tokens over {p * b} positions"
                for w, r, p in self._prefill_shapes()
            ]
            + [f"prompt scoring: {w} tokens" for w in self.scores]
        )

    def warm(self) -> None:
        """Compile every shape in `shapes()` (decoding no slot, prefilling padding only).

        The free memory each compilation leaves in malloc's heap is given back after it
        (`eqllm.hostmem.release_free_memory`). Kept, it added up: smollm2-135m with the
        default flags (54 shapes, a 4 GiB cache) was at 12.4 GiB resident and still compiling
        after 17 minutes; given back, it peaked at 10.5 GiB and was at 7.5 GiB when done."""
        for width, rows, pages in self._prefill_shapes():  # padding rows only: nothing is written
            self._run_prefill([], width, rows, pages)
            release_free_memory()
        for slots, pages, steps in self._decode_shapes():
            self._run_decode(np.zeros(slots, bool), pages, steps)
            release_free_memory()
        for width in self.scores:
            jax.block_until_ready(self._steps["score"](np.zeros(width, np.int32)))
            release_free_memory()

    def _prefill_shapes(self) -> list[tuple[int, int, int]]:
        return [
            (w, r, p)
            for w in self.chunks
            for r in self.prefill_rows[w]
            for p in self.view_pages
            if (r == 1 or p <= self.multi_row_pages) and p * self.block_size >= w
        ]

    def _decode_shapes(self) -> list[tuple[int, int, int]]:
        steps = sorted({1, self.decode_steps})
        return [(b, p, k) for b in self.decode_slots for p in self.view_pages for k in steps]

    # Requests ------------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int] | np.ndarray, params: Params) -> None:
        """Raise ServeError (GenerationError for sampling values) for a request that cannot run."""
        n, vocab = len(prompt), self.config.vocab_size
        if n == 0:
            raise ServeError("prompt is empty; give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ServeError(f"prompt has token ids outside [0, vocab_size={vocab})")
        if params.max_tokens < 0:
            raise ServeError(f"max_tokens must be >= 0, got {params.max_tokens}")
        if n + params.max_tokens > self.max_len:
            raise ServeError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        if params.max_tokens == 0 and not params.prompt_logprobs:
            raise ServeError("max_tokens=0 generates nothing; ask for echo with logprobs or >= 1")
        sampling(
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
        )
        if any(not 0 <= t < vocab for t in params.stop_tokens):
            raise GenerationError(f"stop token ids must lie in [0, vocab_size={vocab})")

    def submit(
        self, prompt: Sequence[int] | np.ndarray, params: Params, sink, *, key=None
    ) -> Request:
        """Queue a request (checked first); QueueFull when `max_queue` requests already wait.
        `key` (a PRNG key) overrides the params' seed."""
        self.check(prompt, params)
        request = Request(prompt, params, sink)
        if key is None:
            key = jax.random.key(secrets.randbits(63) if params.seed is None else params.seed)
        request.key = key
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(
                    f"{len(self._waiting)} requests are already waiting (max_queue="
                    f"{self.max_queue}); retry later"
                )
            self._waiting.append(request)
            self._wake.notify()
        return request

    def busy(self) -> int:
        """Requests waiting or holding a slot."""
        return len(self._waiting) + sum(r is not None for r in self._slots)

    def stats(self) -> dict:
        """The cache's and the prefix cache's counters."""
        return {
            "kv_blocks": self.kv_blocks,
            "kv_blocks_used": self.pool.used(),
            "prefix_hit_rate": round(self.pool.hit_rate(), 4),
            "prefix_hit_tokens": self.pool.hit_tokens,
            "prompt_tokens": self.pool.looked_up_tokens,
            "evicted_blocks": self.pool.evicted,
            "preempted": self.preempted,
        }

    # The loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the scheduling loop in a daemon thread."""
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="eqllm-engine", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop: with `drain`, after the requests already admitted finish (up to
        `timeout` s); what is left is finished with reason "stop"."""
        if drain:
            with self._wake:
                self._wake.wait_for(lambda: self.busy() == 0, timeout=timeout)
        self._running = False
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        for request in [*self._waiting, *self._slots]:
            if request is not None:
                self._finish(request, "stop")
        self._waiting.clear()

    def _loop(self) -> None:
        while self._running:
            self.step()
            with self._wake:
                if self.busy() == 0:
                    self._wake.notify_all()  # for stop(drain=True)
                    self._wake.wait(timeout=0.1)

    def run(self, max_rounds: int) -> None:
        """Step (in this thread) until every request finished; ServeError after `max_rounds`."""
        for _ in range(max_rounds):
            if self.busy() == 0:
                return
            self.step()
        if self.busy():
            raise ServeError(f"requests still running after {max_rounds} rounds")

    def step(self, *, decode: bool = True) -> None:
        """One round: free cancelled slots, admit waiting requests, prefill up to
        `prefill_chunk` prompt tokens (all of them while no request is decoding; over as many
        prompts as they cover, the least advanced first) and run one decode call (each only if
        some slot needs it; `decode` False: no decode call)."""
        for request in self._slots:
            if request is not None and request.cancelled:
                self._finish(request, "stop")
        self._admit()
        decoding = any(r is not None and r.decoding for r in self._slots)
        pending = [r for r in self._slots if r is not None and not r.decoding]
        budget = self.prefill_chunk if decoding else sum(r.target() - r.cursor for r in pending)
        while budget > 0:
            pending = [r for r in self._slots if r is not None and not r.decoding]
            if not pending:
                break
            done = self._prefill(sorted(pending, key=lambda r: r.cursor), budget)
            if done is None:  # no block for any of them: they wait for the running requests
                break
            budget -= done
        if decode:
            self._decode()

    def _admit(self) -> None:
        with self._wake:
            while self._waiting and None in self._slots:
                request = self._waiting.popleft()
                if request.cancelled:
                    request.sink(Finished("stop", len(request.prompt), request.produced))
                    continue
                request.slot = self._slots.index(None)
                request.admitted = next(self._admitted)
                self._slots[request.slot] = request
                self._lookup(request)

    def _lookup(self, request: Request) -> None:
        """Take the cached blocks of the request's longest cached prefix (all but the last
        position is looked up: at least one is computed, for the next token's logits)."""
        usable = (request.target() - 1) // self.block_size * self.block_size
        hashes = block_hashes(request.sequence()[:usable], self.block_size)
        request.blocks = self.pool.lookup(hashes, request.target())
        request.hashes = hashes[: len(request.blocks)]
        request.cursor = request.fresh = len(request.blocks) * self.block_size

    def _finish(self, request: Request, reason: str) -> None:
        self.cancelled += request.cancelled
        if request.slot is not None and self._slots[request.slot] is request:
            self._free_slot(request)
        request.sink(Finished(reason, len(request.prompt), request.produced))

    def _free_slot(self, request: Request) -> None:
        self._slots[request.slot] = None
        self._settings.reset(request.slot)  # an idle slot runs no filter
        self._stops[request.slot] = -1
        self.pool.release(request.blocks)
        request.blocks, request.hashes, request.slot = [], [], None

    def _preempt(self, request: Request) -> None:
        """Give the request's blocks back and queue it first, to be computed again."""
        log.info("preempted a request after %d tokens: the cache is full", request.produced)
        self.preempted += 1
        self._free_slot(request)
        request.cursor, request.decoding = 0, False
        with self._wake:
            self._waiting.appendleft(request)

    def _reserve(self, request: Request, positions: int) -> bool:
        """Blocks for the request's first `positions` positions; when the pool is short, the
        most recently admitted requests after this one are preempted. False if it still lacks
        blocks (nothing younger left to preempt)."""
        while len(request.blocks) * self.block_size < positions:
            block = self.pool.allocate()
            if block is None:
                younger = [
                    r
                    for r in self._slots
                    if r is not None and r.admitted > request.admitted and r.blocks
                ]
                if not younger:
                    return False
                self._preempt(max(younger, key=lambda r: r.admitted))
                continue
            request.blocks.append(block)
        return True

    def _register(self, request: Request) -> None:
        """Record the request's newly full blocks in the prefix cache."""
        full = min(request.cursor // self.block_size, len(request.blocks))
        if full <= len(request.hashes):
            return
        b = self.block_size
        tokens = request.sequence()[len(request.hashes) * b : full * b]
        start = request.hashes[-1] if request.hashes else b""
        for h in block_hashes(tokens, b, start=start):
            self.pool.register(request.blocks[len(request.hashes)], h)
            request.hashes.append(h)

    def _emit(self, request: Request, token: int, logprob: float, top) -> None:
        request.output.append(token)
        request.sink(Token(token, logprob, top if request.params.logprobs else ()))
        p = request.params
        if token in p.stop_tokens:
            self._finish(request, "stop")
        elif request.produced >= p.max_tokens or len(request.prompt) + request.produced > (
            self.max_len
        ):
            self._finish(request, "length")

    # Prefill -------------------------------------------------------------------------------------

    def _prefill(self, pending: list[Request], limit: int) -> int | None:
        """Write the next chunk of as many `pending` sequences as one call takes, at most
        `limit` tokens in all; returns how many (0 when a request only had its prompt scored;
        None when none of them could get a block)."""
        first = pending[0]
        if not first.scored:
            self._score(first)
            if first.params.max_tokens == 0:
                self._finish(first, "length")
                return 0
        widest = max(r.target() - r.cursor for r in pending[: self.prefill_rows[MIN_CHUNK][-1]])
        width = _bucket(min(limit, widest, self.chunks[-1]), self.chunks)
        chunks, pages = [], 0
        for request in pending[: self.prefill_rows[width][-1]]:
            n = min(width, limit, request.target() - request.cursor)
            if n == 0 or not request.scored:
                break  # out of budget, or its prompt is scored first (next call)
            need = _bucket(-(-(request.cursor + n) // self.block_size), self.view_pages)
            if chunks and max(pages, need) > self.multi_row_pages:
                break  # a long sequence goes in a call of its own
            if not self._reserve(request, request.cursor + n):
                if request.slot is None:  # preempted meanwhile by an older request's reserve
                    continue
                break
            chunks.append((request, n))
            pages = max(pages, need)
            limit -= n
        chunks = [(r, n) for r, n in chunks if r.slot is not None]  # not preempted since
        if not chunks:
            return None
        rows = _bucket(len(chunks), self.prefill_rows[width])
        results = self._run_prefill(chunks, width, rows, pages)
        for (request, _), result in zip(chunks, results, strict=True):
            self._register(request)
            if result is not None:
                request.decoding = True
                self._emit(request, *result)
        return sum(n for _, n in chunks)

    def _run_prefill(
        self, chunks: list[tuple[Request, int]], width: int, rows: int, pages: int
    ) -> list:
        """One prefill call: the next `n` positions of each (request, n), left-padded to
        `width`, in `rows` rows (the rest padding), over views of `pages` pages; per request,
        its next token (token, logprob, top alternatives) once its sequence is in, else None."""
        vocab = self.config.vocab_size
        slots = np.full(rows, self.max_batch, np.int32)  # out of range: padding, not written
        table = np.zeros((rows, pages), np.int32)
        tokens = np.zeros((rows, width), np.int32)
        positions = np.full((rows, width), -1, np.int32)
        first, last = np.zeros(rows, bool), np.zeros(rows, bool)
        step = np.zeros(rows, np.int32)
        seen = np.zeros((rows, vocab), bool)
        keys = [jax.random.key(0)] * rows
        settings = RowSettings(rows)
        for i, (request, n) in enumerate(chunks):
            p, start = request.params, request.cursor
            sequence = request.sequence()
            slots[i] = request.slot
            table[i, : min(len(request.blocks), pages)] = request.blocks[:pages]
            tokens[i, width - n :] = sequence[start : start + n]
            positions[i, width - n :] = np.arange(start, start + n)
            request.cursor = start + n
            first[i], last[i] = start == request.fresh, request.cursor == request.target()
            if first[i]:
                seen[i, sequence[:start]] = True
            step[i] = request.produced
            keys[i] = request.key
            chosen = sampling(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)
            settings.set(i, chosen)
            if last[i]:  # its decode settings from now on
                self._settings.set(request.slot, chosen)
                stops = p.stop_tokens[:MAX_STOPS]
                self._stops[request.slot, : len(stops)] = stops
        top = any(r.params.logprobs for r, _ in chunks)
        self._state, out = self._steps["prefill"](
            self._state,
            slots,
            table,
            tokens,
            positions,
            first,
            last,
            jnp.stack(keys),
            step,
            seen,
            settings.stacked(),
            np.asarray(top),
            block_size=self.block_size,
        )
        if not last.any():
            return [None] * len(chunks)
        out = jax.device_get(out)
        return [
            (int(out.token[i]), float(out.logprob[i]), _top(out.top_tokens[i], out.top_logprobs[i]))
            if last[i]
            else None
            for i in range(len(chunks))
        ]

    # Decode --------------------------------------------------------------------------------------

    def _decode(self) -> None:
        """One decode call for every slot whose request is decoding: `decode_steps` tokens
        while no prompt waits for a slot or a prefill, else one."""
        ready = [r for r in self._slots if r is not None and r.decoding]
        if not ready:
            return
        waiting = self._waiting or any(r is not None and not r.decoding for r in self._slots)
        steps = 1 if waiting else self.decode_steps
        if max(r.cursor for r in ready) + steps > self.max_pages * self.block_size:
            steps = 1
        for request in sorted(ready, key=lambda r: r.admitted):
            if request.slot is None:  # preempted by an older one's reservation
                continue
            end = min(request.cursor + steps, len(request.prompt) + request.params.max_tokens)
            if not self._reserve(request, end):
                self._preempt(request)
        ready = [r for r in ready if r.slot is not None]
        if not ready:
            return
        active = np.zeros(self.max_batch, bool)
        active[[r.slot for r in ready]] = True
        reach = max(r.cursor for r in ready) + steps
        pages = _bucket(-(-reach // self.block_size), self.view_pages)
        slots = _bucket(max(r.slot for r in ready) + 1, self.decode_slots)
        out = self._run_decode(active[:slots], pages, steps)
        for request in ready:
            row = request.slot
            for i in range(steps):
                token = int(out.token[row, i])
                if token == NO_TOKEN or request.slot is None or request.cancelled:
                    break
                request.cursor += 1
                top = _top(out.top_tokens[row, i], out.top_logprobs[row, i])
                self._emit(request, token, float(out.logprob[row, i]), top)
            if request.slot is not None:
                self._register(request)

    def _run_decode(self, active: np.ndarray, pages: int, steps: int):
        slots = len(active)
        table = np.zeros((slots, pages), np.int32)
        remaining = np.zeros(slots, np.int32)
        top = False
        for row in np.flatnonzero(active):
            request = self._slots[row]
            table[row, : min(len(request.blocks), pages)] = request.blocks[:pages]
            remaining[row] = request.params.max_tokens - request.produced
            top |= request.params.logprobs
        self._state, out = self._steps["decode"](
            self._state,
            table,
            active,
            remaining,
            self._stops[:slots],
            self._settings.stacked(slots),
            np.asarray(top),
            slots=slots,
            steps=steps,
            block_size=self.block_size,
        )
        return jax.device_get(out)

    def _score(self, request: Request) -> None:
        request.scored = True
        prompt = request.prompt
        width = _bucket(len(prompt), self.scores)
        tokens = np.zeros(width, np.int32)  # right-padded
        tokens[: len(prompt)] = prompt
        out = jax.device_get(self._steps["score"](tokens))
        n = len(prompt) - 1
        tops = [_top(out.top_tokens[i], out.top_logprobs[i]) for i in range(n)]
        request.sink(PromptScores((None, *out.logprob[:n].tolist()), (None, *tops)))


def _top(tokens: np.ndarray, logprobs: np.ndarray) -> tuple:
    return tuple(zip(tokens.tolist(), logprobs.tolist(), strict=True))
