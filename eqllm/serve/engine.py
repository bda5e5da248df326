"""A continuous-batching engine: many requests share one compiled decode step over fixed slots.

A request waits in a bounded queue until a slot is free, then its prompt is written into the
slot's KV cache between two decode steps of the running requests, at most `prefill_chunk` prompt
tokens per round (one long prompt's chunk, or several short prompts), so prompts never stall
the running requests for more than a chunk, and many short ones join in few rounds. Once
prefilled, the slot joins the batch decoded by `decode_step`; it leaves the batch when its
request stops (a stop token, `max_tokens`, the context limit, or a cancel) and the next request
takes it.

Shapes never depend on a request: the slot count and cache length are fixed at start-up and a
prompt chunk is left-padded to a power-of-two bucket, so every compiled shape is known up front
(`Engine.shapes`), and `Engine.warm` compiles them all before serving. The engine runs in its own
thread; results reach each request through the callback it was submitted with.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqllm.generation import GenerationError, sampling
from eqllm.generation.api import MIN_BUCKET
from eqllm.model import CausalLM
from eqllm.serve.placement import check_mesh, state_shardings
from eqllm.serve.request import (
    Finished,
    Params,
    PromptScores,
    QueueFull,
    Request,
    ServeError,
    Token,
)
from eqllm.serve.settings import RowSettings
from eqllm.serve.steps import compiled, empty_state

log = logging.getLogger("eqllm.serve")


def buckets(first: int, last: int, factor: int = 2) -> list[int]:
    """`first`, `first * factor`, ... below `last`, then `last`: the sizes a shape takes."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return [*sizes, last]


def _bucket(n: int, widths: Sequence[int]) -> int:
    return next(w for w in widths if w >= n)


class Engine:
    """Serve many requests at once from one model.

    Arguments:
        model: the language model (any family, any dtype, quantized or not).
        max_batch: slots, i.e. requests decoded together.
        max_len: positions per slot (prompt + output); at most the model's context.
        prefill_chunk: prompt tokens prefilled per round (between two decode steps), a power
            of two >= 16: one prompt's chunk of up to that many (and at most `max_len`), or
            chunks of several prompts at once.
        max_queue: requests allowed to wait for a slot; more raise QueueFull.
        mesh: a device mesh (`eqllm.serve.placement.serving_mesh`) to split the weights and
            the KV cache over `tensor` and the slots over `data`; None: one device.
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
        if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise ServeError(f"prefill_chunk={prefill_chunk} must be a power of two >= 16")
        if mesh is not None:
            check_mesh(cfg, mesh, max_batch)
        self.model, self.mesh = model, mesh
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.prefill_chunk = prefill_chunk
        self.chunks = buckets(MIN_BUCKET, min(prefill_chunk, 1 << (max_len - 1).bit_length()))
        self.scores = buckets(MIN_BUCKET, 1 << (max_len - 1).bit_length())
        # A prefill call writes a chunk of `width` tokens for each of up to prefill_chunk // width
        # prompts at once (their rows padded to 1, 4, 16, ... of them).
        self.prefill_rows = {
            w: buckets(1, min(max_batch, prefill_chunk // w), 4) for w in self.chunks
        }
        # A decode step runs the first b slots and reads the first n cache positions, b and n
        # the smallest of these sizes that cover every active slot: one client does not pay
        # for 32 slots, nor a short reply for the whole context. (Slots split over `data`
        # replicas always run whole, so that each replica keeps its share.)
        split = mesh is not None and mesh.shape["data"] > 1
        self.decode_slots = [max_batch] if split else buckets(1, max_batch, 4)
        self.decode_lengths = buckets(min(128, max_len), max_len, 4)
        self.traces: dict[str, int] = {}
        # The weights the steps run on, as placed: (model without its blocks, sliced layers).
        self._steps, self.weights = compiled(model, self.traces, mesh)
        self._state = empty_state(model, max_batch, max_len)
        if mesh is not None:
            self._state = jax.device_put(self._state, state_shardings(self._state, mesh))
        self._slots: list[Request | None] = [None] * max_batch
        self._settings = RowSettings(max_batch)  # each slot's sampling settings
        self.cancelled = 0  # requests stopped by a cancel (a client that went away)
        self._waiting: deque[Request] = deque()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    # Shapes and warm-up -------------------------------------------------------------------------

    def shapes(self) -> list[str]:
        """Every compiled shape the engine uses, one line each."""
        on = (
            ""
            if self.mesh is None
            else " on mesh "
            + ",".join(f"{k}={v}" for k, v in self.mesh.shape.items() if k in ("data", "tensor"))
        )
        return (
            [f"decode: {b} slots x {n} positions{on}" for b, n in self._decode_shapes()]
            + [f"prefill: {r} prompts x {w} tokens" for w, r in self._prefill_shapes()]
            + [f"prompt scoring: {w} tokens" for w in self.scores]
        )

    def warm(self) -> None:
        """Compile every shape in `shapes()` (decoding no slot, prefilling padding only)."""
        for width, rows in self._prefill_shapes():  # padding rows only: nothing is written
            self._run_prefill([], width, rows)
        for slots, length in self._decode_shapes():
            self._state, out = self._steps["decode"](
                self._state,
                np.zeros(slots, bool),
                self._settings.stacked(slots),
                slots=slots,
                length=length,
            )
        for width in self.scores:
            self._steps["score"](np.zeros(width, np.int32), np.arange(width, dtype=np.int32))
        jax.block_until_ready(out)

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        return [(w, r) for w in self.chunks for r in self.prefill_rows[w]]

    def _decode_shapes(self) -> list[tuple[int, int]]:
        return [(b, n) for b in self.decode_slots for n in self.decode_lengths]

    # Requests ------------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: Params) -> None:
        """Raise ServeError (GenerationError for sampling values) for a request that cannot run."""
        n, vocab = len(prompt), self.model.config.vocab_size
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

    def submit(self, prompt: Sequence[int], params: Params, sink) -> Request:
        """Queue a request (checked first); QueueFull when `max_queue` requests already wait."""
        self.check(prompt, params)
        request = Request(prompt, params, sink)
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

    def step(self) -> None:
        """One round: free cancelled slots, admit waiting requests, prefill up to
        `prefill_chunk` prompt tokens (all of them while no request is decoding; over as many
        prompts as they cover, the least advanced first) and run one decode step (each only if
        some slot needs it)."""
        for request in self._slots:
            if request is not None and request.cancelled:
                self._finish(request, "stop")
        with self._wake:
            while self._waiting and None in self._slots:
                request = self._waiting.popleft()
                if request.cancelled:
                    request.sink(Finished("stop", len(request.prompt), 0))
                    continue
                request.slot = self._slots.index(None)
                self._slots[request.slot] = request
        # Prompt tokens this round, over as many prompts as they cover: the budget keeps the
        # running requests' next tokens from waiting; with none running, every prompt goes in.
        running = any(r is not None and r.cursor == len(r.prompt) for r in self._slots)
        budget = self.prefill_chunk if running else sum(len(r.prompt) for r in self._slots if r)
        while budget > 0:
            pending = [r for r in self._slots if r is not None and r.cursor < len(r.prompt)]
            if not pending:
                break
            budget -= self._prefill(sorted(pending, key=lambda r: r.cursor), budget)
        active = np.array([r is not None and r.cursor == len(r.prompt) for r in self._slots])
        if active.any():
            self._decode(active)

    def _finish(self, request: Request, reason: str) -> None:
        self.cancelled += request.cancelled
        if request.slot is not None and self._slots[request.slot] is request:
            self._slots[request.slot] = None
            self._settings.reset(request.slot)  # an idle slot runs no filter
        request.sink(Finished(reason, len(request.prompt), request.produced))

    def _emit(self, request: Request, token: int, logprob: float, top) -> None:
        request.produced += 1
        request.sink(Token(token, logprob, top))
        p = request.params
        if token in p.stop_tokens:
            self._finish(request, "stop")
        elif request.produced >= p.max_tokens or len(request.prompt) + request.produced > (
            self.max_len
        ):
            self._finish(request, "length")

    def _prefill(self, pending: list[Request], limit: int) -> int:
        """Write the next chunk of as many `pending` prompts as one call takes (the first's
        chunk sets the width; the others' chunks are cut to it), at most `limit` tokens in all;
        returns how many (0 when a request only had its prompt scored)."""
        first = pending[0]
        if not first.scored:
            self._score(first)
            if first.params.max_tokens == 0:
                self._finish(first, "length")
                return 0
        width = _bucket(min(limit, len(first.prompt) - first.cursor, self.chunks[-1]), self.chunks)
        chunks = []
        for request in pending[: self.prefill_rows[width][-1]]:
            n = min(width, limit, len(request.prompt) - request.cursor)
            if n == 0 or not request.scored:
                break  # out of budget, or its prompt is scored first (next call)
            chunks.append((request, n))
            limit -= n
        results = self._run_prefill(chunks, width, _bucket(len(chunks), self.prefill_rows[width]))
        for (request, _), result in zip(chunks, results, strict=True):
            if result is not None:
                self._emit(request, *result)
        return sum(n for _, n in chunks)

    def _run_prefill(self, chunks: list[tuple[Request, int]], width: int, rows: int) -> list:
        """One prefill call: the next `n` prompt tokens of each (request, n), left-padded to
        `width`, in `rows` rows (the rest padding); per request, its first token (token,
        logprob, top alternatives) once its prompt is in, else None."""
        slots = np.full(rows, self.max_batch, np.int32)  # out of range: padding, not written
        tokens = np.zeros((rows, width), np.int32)
        positions = np.full((rows, width), -1, np.int32)
        first, last = np.zeros(rows, bool), np.zeros(rows, bool)
        keys = [jax.random.key(0)] * rows
        settings = RowSettings(rows)
        for i, (request, n) in enumerate(chunks):
            p, start = request.params, request.cursor
            slots[i] = request.slot
            tokens[i, width - n :] = request.prompt[start : start + n]
            positions[i, width - n :] = np.arange(start, start + n)
            request.cursor = start + n
            first[i], last[i] = start == 0, request.cursor == len(request.prompt)
            keys[i] = jax.random.key(secrets.randbits(63) if p.seed is None else p.seed)
            chosen = sampling(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)
            settings.set(i, chosen)
            if last[i]:  # its decode settings from now on
                self._settings.set(request.slot, chosen)
        self._state, out = self._steps["prefill"](
            self._state, slots, tokens, positions, first, last, jnp.stack(keys), settings.stacked()
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

    def _decode(self, active: np.ndarray) -> None:
        slots = _bucket(int(np.flatnonzero(active)[-1]) + 1, self.decode_slots)
        # the token fed to slot i sits at position len(prompt) + produced - 1
        longest = max(
            len(self._slots[i].prompt) + self._slots[i].produced for i in np.flatnonzero(active)
        )
        self._state, out = self._steps["decode"](
            self._state,
            active[:slots],
            self._settings.stacked(slots),
            slots=slots,
            length=_bucket(longest, self.decode_lengths),
        )
        out = jax.device_get(out)
        for slot in np.flatnonzero(active):
            request = self._slots[slot]
            if request is None or request.cancelled:
                continue
            top = _top(out.top_tokens[slot], out.top_logprobs[slot])
            self._emit(request, int(out.token[slot]), float(out.logprob[slot]), top)

    def _score(self, request: Request) -> None:
        request.scored = True
        prompt = request.prompt
        width = _bucket(len(prompt), self.scores)
        tokens = np.zeros(width, np.int32)
        positions = np.full(width, -1, np.int32)
        tokens[: len(prompt)] = prompt
        positions[: len(prompt)] = np.arange(len(prompt))
        out = jax.device_get(self._steps["score"](tokens, positions))
        n = len(prompt) - 1
        tops = [_top(out.top_tokens[i], out.top_logprobs[i]) for i in range(n)]
        request.sink(PromptScores((None, *out.logprob[:n].tolist()), (None, *tops)))


def _top(tokens: np.ndarray, logprobs: np.ndarray) -> tuple:
    return tuple(zip(tokens.tolist(), logprobs.tolist(), strict=True))
