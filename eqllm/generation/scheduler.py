"""The engine's bookkeeping on the host: which request holds which slot, which wait, and which
cache blocks each holds. Nothing here touches the device.

A request waits in a bounded queue until a slot is free. On joining it takes the cached blocks
of its prompt's longest cached prefix (`eqllm.generation.pages`) and starts after them. It takes
blocks as it grows; when the pool runs short, the most recently admitted request is preempted:
its blocks go back (cached, so that it may find them again) and it waits at the head of the
queue to be computed again. Blocks are recorded in the prefix cache as they fill. A request
leaves when it stops (a stop token, `max_tokens`, the context, or a cancel) and gives its
blocks back.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque

import numpy as np

from eqllm.generation.pages import BlockPool, block_hashes
from eqllm.generation.requests import Finished, QueueFull, Request, Token
from eqllm.generation.sampling import sampling
from eqllm.generation.settings import RowSettings

log = logging.getLogger("eqllm.serve")

MAX_STOPS = 8  # stop ids the decode loop checks on device (the host checks every one)


class Scheduler:
    """The slots, the waiting queue and the block pool of an engine, and each slot's decode
    settings (its sampling settings and stop ids, as the decode step takes them).

    Arguments:
        pool: the cache's blocks.
        max_batch: slots.
        max_len: positions per request (prompt + output).
    """

    def __init__(self, pool: BlockPool, max_batch: int, max_len: int):
        self.pool, self.block_size, self.max_len = pool, pool.block_size, max_len
        self.slots: list[Request | None] = [None] * max_batch
        self.settings = RowSettings(max_batch)  # each slot's sampling settings
        self.stops = np.full((max_batch, MAX_STOPS), -1, np.int32)
        self.waiting: deque[Request] = deque()
        self.wake = threading.Condition()  # guards `waiting`; wakes the engine's loop
        self._admitted = itertools.count()
        self.cancelled = 0  # requests stopped by a cancel (a client that went away)
        self.preempted = 0  # times a request gave its blocks back to let others run

    def enqueue(self, request: Request, max_queue: int) -> None:
        """Queue the request; QueueFull when `max_queue` requests already wait."""
        with self.wake:
            if len(self.waiting) >= max_queue:
                raise QueueFull(
                    f"{len(self.waiting)} requests are already waiting (max_queue="
                    f"{max_queue}); retry later"
                )
            self.waiting.append(request)
            self.wake.notify()

    def busy(self) -> int:
        """Requests waiting or holding a slot."""
        return len(self.waiting) + sum(r is not None for r in self.slots)

    def admit(self) -> None:
        """Give free slots to waiting requests, first come first served."""
        with self.wake:
            while self.waiting and None in self.slots:
                request = self.waiting.popleft()
                if request.cancelled:
                    request.sink(Finished("stop", len(request.prompt), request.produced))
                    continue
                request.slot = self.slots.index(None)
                request.admitted = next(self._admitted)
                self.slots[request.slot] = request
                self._lookup(request)

    def _lookup(self, request: Request) -> None:
        """Take the cached blocks of the request's longest cached prefix (all but the last
        position is looked up: at least one is computed, for the next token's logits)."""
        usable = (request.target() - 1) // self.block_size * self.block_size
        hashes = block_hashes(request.sequence()[:usable], self.block_size, _salt(request))
        request.blocks = self.pool.lookup(hashes, request.target())
        request.hashes = hashes[: len(request.blocks)]
        request.cursor = request.fresh = len(request.blocks) * self.block_size

    def start_decoding(self, request: Request) -> None:
        """The request's prompt is in: its slot decodes with its settings from now on."""
        p = request.params
        request.decoding = True
        self.settings.set(
            request.slot, sampling(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)
        )
        stops = p.stop_tokens[:MAX_STOPS]
        self.stops[request.slot, : len(stops)] = stops

    def emit(self, request: Request, token: int, logprob: float, top) -> None:
        """Send the request its next token; finish it if that was its last."""
        request.output.append(token)
        if request.constraint is not None:
            request.constraint.accept(token)
        request.sink(Token(token, logprob, top if request.params.logprobs else ()))
        p = request.params
        if token in p.stop_tokens or (request.constraint and request.constraint.finished):
            self.finish(request, "stop")
        elif request.produced >= p.max_tokens or len(request.prompt) + request.produced > (
            self.max_len
        ):
            self.finish(request, "length")

    def finish(self, request: Request, reason: str) -> None:
        """Free the request's slot (if it holds one) and tell it why it ended."""
        self.cancelled += request.cancelled
        if request.slot is not None and self.slots[request.slot] is request:
            self._free_slot(request)
        request.sink(Finished(reason, len(request.prompt), request.produced))

    def _free_slot(self, request: Request) -> None:
        self.slots[request.slot] = None
        self.settings.reset(request.slot)  # an idle slot runs no filter
        self.stops[request.slot] = -1
        self.pool.release(request.blocks)
        request.blocks, request.hashes, request.slot = [], [], None

    def preempt(self, request: Request) -> None:
        """Give the request's blocks back and queue it first, to be computed again."""
        log.info("preempted a request after %d tokens: the cache is full", request.produced)
        self.preempted += 1
        self._free_slot(request)
        request.cursor, request.decoding = 0, False
        with self.wake:
            self.waiting.appendleft(request)

    def reserve(self, request: Request, positions: int) -> bool:
        """Blocks for the request's first `positions` positions; when the pool is short, the
        most recently admitted requests after this one are preempted. False if it still lacks
        blocks (nothing younger left to preempt)."""
        while len(request.blocks) * self.block_size < positions:
            block = self.pool.allocate()
            if block is None:
                younger = [
                    r
                    for r in self.slots
                    if r is not None and r.admitted > request.admitted and r.blocks
                ]
                if not younger:
                    return False
                self.preempt(max(younger, key=lambda r: r.admitted))
                continue
            request.blocks.append(block)
        return True

    def register(self, request: Request) -> None:
        """Record the request's newly full blocks in the prefix cache."""
        full = min(request.cursor // self.block_size, len(request.blocks))
        if full <= len(request.hashes):
            return
        b = self.block_size
        tokens = request.sequence()[len(request.hashes) * b : full * b]
        start = request.hashes[-1] if request.hashes else b""
        for h in block_hashes(tokens, b, _salt(request), start=start):
            self.pool.register(request.blocks[len(request.hashes)], h)
            request.hashes.append(h)


def _salt(request: Request) -> str:
    """What keeps blocks computed under different LoRA adapters apart in the prefix cache."""
    return f"adapter {request.params.adapter}" if request.params.adapter else ""
