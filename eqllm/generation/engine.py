"""The continuous-batching engine: every generation in eqllm runs on it.

`eqllm.generate`, `generate_batch` and `stream` make an engine for their prompts; `eqllm serve`
keeps one for its lifetime; evaluation samples, the lm-evaluation-harness backend and GRPO
rollouts go through `generate_batch`. One cache layout, one sampler, one way a sequence joins
and leaves.

A request waits in a bounded queue until a slot is free. On joining it looks its prompt's full
blocks up in the prefix cache (`eqllm.generation.pages`) and starts after the blocks found.
Between two decode steps of the running requests, up to `prefill_chunk` prompt tokens are
written into the cache (one long prompt's chunk, or several short prompts in one call; while
none decodes, every prompt with a slot at once; while prompts outnumber the decoding requests,
a chunk of each). Once prefilled, a request joins the batch the decode step runs; it leaves
when it stops (a stop token, `max_tokens`, the context, or a cancel) and gives its blocks back
(full ones stay cached for reuse until evicted).

The cache is a pool of blocks sized by a memory budget, not by slots x context: a request takes
blocks as it grows. When the pool runs short, the most recently admitted request is preempted:
its blocks go back (cached, so that it may find them again) and it waits at the head of the
queue to be computed again, drawing the tokens it would have drawn.

Shapes never depend on a request: slot counts, chunk widths and view lengths are buckets fixed
at start-up, so every compiled shape is known up front (`Engine.shapes`) and `Engine.warm`
compiles them all before serving (an engine made for one batch, as `generate_batch` makes,
compiles what it meets instead). The engine runs in its own thread when started; results reach
each request through the callback it was submitted with.

With `speculate`, every decode call is a speculative round instead: K guesses per slot
verified by one target call (`eqllm.generation.speculator`, `eqllm.generation.speculate`).

This module decides what runs when; `scheduler` keeps the slots, the queue and each request's
blocks, `runner` the device state and each call's arrays, `sizing` the cache's size and buckets.
"""

from __future__ import annotations

import gc
import secrets
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from eqllm.generation import adapters
from eqllm.generation.constrain import refuse_speculation
from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.pages import BlockPool
from eqllm.generation.placement import check_mesh
from eqllm.generation.requests import Params, Request, ServeError, check_request
from eqllm.generation.runner import Runner, top_alternatives
from eqllm.generation.scheduler import Scheduler
from eqllm.generation.sizing import MIN_CHUNK, Buckets, check_settings, pool_blocks, round_up
from eqllm.generation.speculator import Speculator, check_speculation
from eqllm.generation.steps import NO_TOKEN
from eqllm.hostmem import release_free_memory
from eqllm.model import CausalLM


class Engine:
    """Generate for many requests at once from one model.

    Arguments:
        model: the language model (any family, any dtype, quantized or not).
        max_batch: slots, i.e. requests decoded together.
        max_len: positions per request (prompt + output), at most the model's context (None: it).
        prefill_chunk: prompt tokens prefilled per round (between two decode steps), a power
            of two >= 16: one prompt's chunk of up to that many, or chunks of several prompts.
        max_queue: requests allowed to wait for a slot; more raise QueueFull.
        mesh: a device mesh (`eqllm.generation.placement.serving_mesh`) to split the weights and
            the cache over `tensor` and the slots over `data`; None: one device.
        block_size: positions per cache block.
        kv_blocks: blocks in the cache pool (None: as many as `kv_memory` holds, at most enough
            for every slot at `max_len`).
        kv_memory: the cache's budget in bytes (None: `sizing.default_kv_memory()`).
        prefix_cache: reuse the cached blocks of equal prompt prefixes (not for a hybrid).
        decode_steps: tokens a decode call runs on device while no prompt waits to be prefilled
            (1: a new request joins after at most one token of the others).
        view_lengths: the cache positions a step may read, as buckets (None: 128, 512, 2048, ...
            up to `max_len`, so one request does not pay for the whole context).
        speculate: guesses K per speculative round (None: off): each decode round then
            verifies K guessed tokens per slot in one target call (`eqllm.generation.speculate`).
        draft: the model the guesses come from (same vocabulary; None: prompt lookup).

    `scheduler` holds the slots, the queue and the blocks; `runner` the device state and the
    compiled steps.
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
        speculate: int | None = None,
        draft: CausalLM | None = None,
    ):
        cfg = model.config
        prefix_cache = prefix_cache and cfg.linear is None  # see eqllm.generation.recurrent
        max_len = cfg.max_seq_len if max_len is None else max_len
        check_settings(cfg, max_batch, max_len, prefill_chunk, block_size, decode_steps)
        if mesh is not None:
            check_mesh(cfg, mesh, max_batch)
        check_speculation(model, speculate, draft, max_len, decode_steps, mesh)
        self.config, self.mesh = cfg, mesh
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.prefill_chunk, self.block_size = prefill_chunk, block_size
        self.decode_steps = decode_steps
        self.max_pages = -(-max_len // block_size)
        self.kv_blocks = pool_blocks(
            kv_blocks,
            kv_memory,
            block_bytes=block_size * bytes_per_token(model),
            block_size=block_size,
            max_batch=max_batch,
            max_len=max_len,
            mesh=mesh,
            slot_bytes=state_bytes(model),
        )
        self.kv_bytes = self.kv_blocks * block_size * bytes_per_token(model)
        self.state_bytes = max_batch * state_bytes(model)  # every slot's recurrent state
        if bytes_per_token(model) == 0:  # no attention layer: no pool to read, one view length
            view_lengths = [max_len]
        # Slots split over `data` replicas always run whole, so that each replica keeps its share.
        self.buckets = Buckets.make(
            max_batch=max_batch,
            max_len=max_len,
            prefill_chunk=prefill_chunk,
            block_size=block_size,
            decode_steps=decode_steps,
            view_lengths=view_lengths,
            whole_batch=mesh is not None and mesh.shape["data"] > 1,
        )
        self.runner = Runner(model, mesh, max_batch, self.kv_blocks, block_size)
        self.pool = BlockPool(self.kv_blocks, block_size, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(self.pool, max_batch, max_len)
        self.speculator = (
            Speculator(self.runner, speculate, draft, self.kv_blocks) if speculate else None
        )
        self._running = False
        self._thread: threading.Thread | None = None

    # Shapes and warm-up -------------------------------------------------------------------------

    def describe(self) -> str:
        """One line on the cache: blocks, positions and bytes reserved."""
        positions = self.kv_blocks * self.block_size
        return (
            f"KV cache: {self.kv_blocks:,} blocks of {self.block_size} positions = "
            f"{positions:,} positions ({positions / self.max_len:.1f} x max_len={self.max_len:,}), "
            f"{self.kv_bytes / 2**30:.2f} GiB reserved; {self.max_batch} slots"
            + (f"; recurrent state {self.state_bytes / 2**20:,.1f} MiB" if self.state_bytes else "")
            + ("" if self.pool.prefix_cache else "; prefix cache off")
            + ("" if self.speculator is None else f"; {self.speculator.describe()}")
        )

    def shapes(self) -> list[str]:
        """Every compiled shape the engine uses, one line each."""
        lines = self.buckets.lines(self.block_size, self.mesh)
        if self.speculator is None:
            return lines
        drafted = self.speculator.draft is not None  # every decode call is a round
        return self.speculator.lines(self.buckets) + [
            x for x in lines if not (drafted and x.startswith("decode:"))
        ]

    def warm(self) -> None:
        """Compile and run every shape in `shapes()` once (prefilling padding only, decoding
        every slot over block 0, then emptying every slot and pool).

        The free memory each compilation leaves in malloc's heap is given back after it
        (`eqllm.hostmem.release_free_memory`): kept, smollm2-135m's 54 default shapes held 12.4
        GiB and were still compiling after 17 minutes; given back, 10.5 GiB at the peak."""
        for width, rows, pages in self.buckets.prefill_shapes():  # padding only: nothing written
            self.runner.prefill([], width, rows, pages)
            release_free_memory()
        for slots, pages, steps in self.buckets.decode_shapes():
            if self.speculator is None or self.speculator.draft is None:
                settings = self.scheduler.settings.stacked(slots)
                self.runner.warm_decode(slots, pages, steps, settings, self.scheduler.stops[:slots])
            if self.speculator is not None:  # a speculative round for no slot
                k = self.speculator.k
                zeros = np.zeros(slots, np.int32)
                self.speculator.run(self.scheduler, pages, np.zeros((slots, k), np.int32), zeros)
            release_free_memory()
        for width in self.buckets.scores:
            self.runner.score(np.zeros(1, np.int32), width)
            release_free_memory()
        self.runner.clear()  # what the live decode calls wrote

    # Requests ------------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int] | np.ndarray, params: Params) -> None:
        """Raise ServeError (GenerationError for sampling values) for a request that cannot run."""
        check_request(prompt, params, vocab=self.config.vocab_size, max_len=self.max_len)
        adapters.check_adapter(params.adapter, self.runner.adapters)

    def submit(self, prompt, params: Params, sink, *, key=None, constraint=None) -> Request:
        """Queue a request (checked first); QueueFull when `max_queue` requests already wait.
        `key` (a PRNG key) overrides the params' seed; `constraint` masks its tokens."""
        self.check(prompt, params)
        refuse_speculation(constraint, self.speculator)
        request = Request(prompt, params, sink, constraint)
        if key is None:
            key = jax.random.key(secrets.randbits(63) if params.seed is None else params.seed)
        request.key = key
        self.scheduler.enqueue(request, self.max_queue)
        return request

    def busy(self) -> int:
        """Requests waiting or holding a slot."""
        return self.scheduler.busy()

    def stats(self) -> dict:
        """The cache's and the prefix cache's counters."""
        return {
            "kv_blocks": self.kv_blocks,
            "kv_blocks_used": self.pool.used(),
            "prefix_hit_rate": round(self.pool.hit_rate(), 4),
            "prefix_hit_tokens": self.pool.hit_tokens,
            "prompt_tokens": self.pool.looked_up_tokens,
            "evicted_blocks": self.pool.evicted,
            "preempted": self.scheduler.preempted,
        } | ({} if self.speculator is None else self.speculator.stats())

    # The loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the scheduling loop in a daemon thread. What lives by now (model, JAX's caches,
        the app) is frozen out of the garbage collector: a full collection walked it all with
        the interpreter lock held (0.1-0.55 s), stalling the engine and every request."""
        gc.collect()
        gc.freeze()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="eqllm-engine", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop: with `drain`, after the requests already admitted finish (up to
        `timeout` s); what is left is finished with reason "stop"."""
        if drain:
            with self.scheduler.wake:
                self.scheduler.wake.wait_for(lambda: self.busy() == 0, timeout=timeout)
        self._running = False
        with self.scheduler.wake:
            self.scheduler.wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        for request in [*self.scheduler.waiting, *self.scheduler.slots]:
            if request is not None:
                self.scheduler.finish(request, "stop")
        self.scheduler.waiting.clear()

    def _loop(self) -> None:
        while self._running:
            self.step()
            with self.scheduler.wake:
                if self.busy() == 0:
                    self.scheduler.wake.notify_all()  # for stop(drain=True)
                    self.scheduler.wake.wait(timeout=0.1)

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
        `prefill_chunk` prompt tokens (all while none decodes, one chunk per prompt while they
        outnumber the decoding ones; the least advanced first) and run one decode call (each
        only if some slot needs it; `decode` False: no decode call)."""
        slots = self.scheduler.slots
        for request in slots:
            if request is not None and request.cancelled:
                self.scheduler.finish(request, "stop")
        decoding = sum(r is not None and r.decoding for r in slots)
        # A decode call reads every weight, for a few sequences as for many: prompts arriving
        # together decode together, not in turns. `left`: tokens each prompt of the round had.
        left, spent = {}, 0
        while True:
            self.scheduler.admit()  # those that came during the last call join too
            pending = [r for r in slots if r is not None and not r.decoding]
            left |= {id(r): r.target() - r.cursor for r in pending if id(r) not in left}
            chunks = len(left) if len(left) > decoding else 1
            budget = sum(left.values())
            budget = (min(budget, self.prefill_chunk * chunks) if decoding else budget) - spent
            if not pending or budget <= 0:
                break
            done = self._prefill(sorted(pending, key=lambda r: r.cursor), budget)
            if done is None:  # no block for any of them: they wait for the running requests
                break
            spent += done
        if decode:
            self._decode()

    # Prefill -------------------------------------------------------------------------------------

    def _prefill(self, pending: list[Request], limit: int) -> int | None:
        """Write the next chunk of as many `pending` sequences as one call takes, at most
        `limit` tokens in all; returns how many (0 when a request only had its prompt scored;
        None when none of them could get a block)."""
        first = pending[0]
        if not first.scored:
            first.scored = True
            width = round_up(len(first.prompt), self.buckets.scores)
            first.sink(self.runner.score(first.prompt, width, first.params.adapter))
            if first.params.max_tokens == 0:
                self.scheduler.finish(first, "length")
                return 0
        sizes = self.buckets
        widest = max(r.target() - r.cursor for r in pending[: sizes.prefill_rows[MIN_CHUNK][-1]])
        width = round_up(min(limit, widest, sizes.chunks[-1]), sizes.chunks)
        chunks, pages = [], 0
        for request in pending[: sizes.prefill_rows[width][-1]]:
            n = min(width, limit, request.target() - request.cursor)
            if n == 0 or not request.scored:
                break  # out of budget, or its prompt is scored first (next call)
            need = round_up(-(-(request.cursor + n) // self.block_size), sizes.view_pages)
            if chunks and max(pages, need) > sizes.multi_row_pages:
                break  # a long sequence goes in a call of its own
            if not self.scheduler.reserve(request, request.cursor + n):
                if request.slot is None:  # preempted meanwhile by an older request's reserve
                    continue
                break
            chunks.append((request, n))
            pages = max(pages, need)
            limit -= n
        chunks = [(r, n) for r, n in chunks if r.slot is not None]  # not preempted since
        if not chunks:
            return None
        rows = round_up(len(chunks), sizes.prefill_rows[width])
        results = self.runner.prefill(chunks, width, rows, pages)
        for (request, _), result in zip(chunks, results, strict=True):
            self.scheduler.register(request)
            if result is not None:
                self.scheduler.start_decoding(request)
                self.scheduler.emit(request, *result)
        return sum(n for _, n in chunks)

    # Decode --------------------------------------------------------------------------------------

    def _decode(self) -> None:
        """One decode call for every slot whose request is decoding: `decode_steps` tokens
        while no prompt waits for a slot or a prefill, else one."""
        held = self.scheduler.slots
        ready = [r for r in held if r is not None and r.decoding]
        if not ready:
            return
        if self.speculator is not None:
            return self.speculator.decode(self.scheduler, ready, self.buckets)
        waiting = self.scheduler.waiting or any(r is not None and not r.decoding for r in held)
        steps = 1 if waiting or any(r.constraint for r in ready) else self.decode_steps
        if max(r.cursor for r in ready) + steps > self.max_pages * self.block_size:
            steps = 1
        for request in sorted(ready, key=lambda r: r.admitted):
            if request.slot is None:  # preempted by an older one's reservation
                continue
            end = min(request.cursor + steps, len(request.prompt) + request.params.max_tokens)
            if not self.scheduler.reserve(request, end):
                self.scheduler.preempt(request)
        ready = [r for r in ready if r.slot is not None]
        if not ready:
            return
        active = np.zeros(self.max_batch, bool)
        active[[r.slot for r in ready]] = True
        reach = max(r.cursor for r in ready) + steps
        pages = round_up(-(-reach // self.block_size), self.buckets.view_pages)
        slots = round_up(max(r.slot for r in ready) + 1, self.buckets.decode_slots)
        out = self._run_decode(active[:slots], pages, steps)
        for request in ready:
            row = request.slot
            for i in range(steps):
                token = int(out.token[row, i])
                if token == NO_TOKEN or request.slot is None or request.cancelled:
                    break
                request.cursor += 1
                top = top_alternatives(out.top_tokens[row, i], out.top_logprobs[row, i])
                self.scheduler.emit(request, token, float(out.logprob[row, i]), top)
            if request.slot is not None:
                self.scheduler.register(request)

    def _run_decode(self, active: np.ndarray, pages: int, steps: int):
        slots = len(active)
        settings = self.scheduler.settings.stacked(slots)
        stops = self.scheduler.stops[:slots]
        return self.runner.decode(self.scheduler.slots, active, pages, steps, settings, stops)
