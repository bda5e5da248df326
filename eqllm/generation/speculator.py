"""Speculative decoding's host side: where each round's guesses come from (prompt lookup, or
the draft model's compiled proposal), the blocks a round writes, and the tokens it kept sent to
each request. The device side, and the rule that keeps the target's distribution, are in
`eqllm.generation.speculate`."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np

from eqllm.generation.recurrent import refuse_speculation
from eqllm.generation.requests import Request, ServeError
from eqllm.generation.runner import Runner, top_alternatives
from eqllm.generation.scheduler import Scheduler
from eqllm.generation.sizing import Buckets, round_up
from eqllm.generation.speculate import jitted, propose, verify
from eqllm.generation.steps import NO_TOKEN, TRACES
from eqllm.model import CausalLM

NGRAM = (3, 2, 1)  # the suffix lengths prompt lookup tries, longest first
MAX_SPECULATE = 16


def lookup(sequence: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Prompt lookup: the (up to `k`) tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the longest n in NGRAM that occurs; none if none does."""
    sequence = np.asarray(sequence)
    for n in NGRAM:
        if len(sequence) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)
        found = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
        if found.size:
            start = found[-1] + n
            return sequence[start : start + k]
    return sequence[:0]


class Speculator:
    """The engine's speculative rounds: K guesses per decoding slot, from prompt lookup
    (`draft` None) or from a draft model with its own state and pools of `blocks` blocks (its
    prefills run with the target's: `runner.draft`), verified by the target.

    `proposed` and `accepted` count guesses over all rounds; `rounds` slot-rounds; `traces`
    how often each step was traced for this engine.
    """

    def __init__(self, runner: Runner, k: int, draft: CausalLM | None, blocks: int):
        self.k, self.runner = k, runner
        self.traces: dict[str, int] = {}
        self.proposed = self.accepted = self.rounds = 0
        params, static = eqx.partition(runner.weights, eqx.is_array)
        verify_step = jitted("verify", verify, static, (1,), ("slots", "block_size"))
        self._verify = self._counted("verify", verify_step, params)
        self.draft: Runner | None = None
        if draft is not None:
            self.draft = Runner(draft, None, runner.max_batch, blocks, runner.block_size)
            runner.draft = self.draft
            params, static = eqx.partition(self.draft.weights, eqx.is_array)
            names = ("slots", "width", "block_size")
            self._propose = self._counted(
                "propose", jitted("propose", propose, static, (1,), names), params
            )

    def describe(self) -> str:
        """One line on the speculation: K and the guesses' source (and the draft's cache)."""
        if self.draft is None:
            return f"speculating {self.k} tokens per round by prompt lookup"
        state = self.draft.state.cache
        size = sum(x.nbytes for pool in state for x in pool.data.values())
        return f"speculating {self.k} tokens per round from a draft ({size / 2**30:.2f} GiB cache)"

    def _counted(self, name: str, fn, params):
        def call(*args, **sizes):
            before = TRACES.get(name, 0)
            out = fn(params, *args, **sizes)
            if TRACES.get(name, 0) != before:
                self.traces[name] = self.traces.get(name, 0) + TRACES[name] - before
            return out

        return call

    def lines(self, buckets: Buckets) -> list[str]:
        """The compiled shapes of a round, one line each (with a draft they replace the decode
        shapes; prompt lookup decodes plainly when it has no guess for any slot)."""
        b, source = buckets.block_size, "prompt lookup" if self.draft is None else "draft model"
        return [
            f"speculate ({source}): {s} slots x {p * b} positions x {self.k + 1} tokens"
            for s, p in self.shapes(buckets)
        ]

    @staticmethod
    def shapes(buckets: Buckets) -> list[tuple[int, int]]:
        return [(s, p) for s in buckets.decode_slots for p in buckets.view_pages]

    def stats(self) -> dict:
        """Guesses proposed and accepted, and the share accepted."""
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {
            "speculative_proposed": self.proposed,
            "speculative_accepted": self.accepted,
            "speculative_acceptance": round(rate, 4),
        }

    def decode(self, scheduler: Scheduler, ready: list[Request], buckets: Buckets) -> None:
        """One round for the `ready` (decoding) requests: blocks for the positions it writes
        (preempting as a decode step does), guesses, the compiled round, and the tokens it
        kept sent to each request."""
        guesses: dict[int, np.ndarray] = {}
        for request in sorted(ready, key=lambda r: r.admitted):
            if request.slot is None:  # preempted by an older one's reservation
                continue
            room = min(self.k, request.params.max_tokens - request.produced - 1)
            if self.draft is None:
                guess = lookup(request.sequence(), room) if room > 0 else np.zeros(0, np.int32)
            else:
                guess = np.zeros(max(room, 0), np.int32)  # drawn on device
            guesses[id(request)] = guess
            if not scheduler.reserve(request, request.cursor + len(guess) + 1):
                scheduler.preempt(request)
        ready = [r for r in ready if r.slot is not None]
        if not ready:
            return
        reach = max(r.cursor + len(guesses[id(r)]) + 1 for r in ready)
        pages = round_up(-(-reach // buckets.block_size), buckets.view_pages)
        slots = round_up(max(r.slot for r in ready) + 1, buckets.decode_slots)
        guess = np.zeros((slots, self.k), np.int32)
        count = np.zeros(slots, np.int32)
        for request in ready:
            g = guesses[id(request)]
            guess[request.slot, : len(g)], count[request.slot] = g, len(g)
        if self.draft is None and not count.any():  # no guess anywhere: a plain decode step
            out = self.plain(scheduler, pages, slots)
        else:
            out = self.run(scheduler, pages, guess, count)
        for request in ready:
            row = request.slot
            kept = int(np.sum(out.token[row] != NO_TOKEN)) - 1
            self.proposed, self.accepted = self.proposed + int(count[row]), self.accepted + kept
            self.rounds += 1
            for i in range(out.token.shape[1]):
                token = int(out.token[row, i])
                if token == NO_TOKEN or request.slot is None or request.cancelled:
                    break
                request.cursor += 1
                top = top_alternatives(out.top_tokens[row, i], out.top_logprobs[row, i])
                scheduler.emit(request, token, float(out.logprob[row, i]), top)
            if request.slot is not None:
                scheduler.register(request)

    def plain(self, scheduler: Scheduler, pages: int, slots: int):
        """The decode step of one token for the first `slots` slots' decoding requests."""
        active = np.asarray([r is not None and r.decoding for r in scheduler.slots[:slots]])
        settings, stops = scheduler.settings.stacked(slots), scheduler.stops[:slots]
        return self.runner.decode(scheduler.slots, active, pages, 1, settings, stops)

    def run(self, scheduler: Scheduler, pages: int, guess: np.ndarray, count: np.ndarray):
        """One compiled round for the first len(count) slots (a slot is active when it holds
        a decoding request), over views of `pages` pages; what it emitted, on the host."""
        slots = len(count)
        table = np.zeros((slots, pages), np.int32)
        active = np.zeros(slots, bool)
        adapter = np.zeros(slots, np.int32)  # each row's LoRA adapter (0: none)
        top = False
        for row, request in enumerate(scheduler.slots[:slots]):
            if request is not None and request.decoding:
                active[row] = True
                table[row, : min(len(request.blocks), pages)] = request.blocks[:pages]
                top |= request.params.logprobs
                adapter[row] = request.params.adapter
        settings = scheduler.settings.stacked(slots)
        state, bs = self.runner.state, self.runner.block_size
        q = None
        if self.draft is not None:
            self.draft.state, guess, q = self._propose(
                self.draft.state, state, table, active, count, settings,
                slots=slots, width=self.k + 1, block_size=bs,
            )  # fmt: skip
        self.runner.state, out = self._verify(
            state, table, active, guess, count, q, settings, np.asarray(top),
            adapter if self.runner.adapters else None, slots=slots, block_size=bs,
        )  # fmt: skip
        return jax.device_get(out)


def check_speculation(
    model: CausalLM,
    k: int | None,
    draft: CausalLM | None,
    max_len: int,
    decode_steps: int,
    mesh,
) -> None:
    """Raise ServeError for speculation settings an engine cannot run."""
    if k is None:
        if draft is not None:
            raise ServeError("a draft model needs speculate=K (guesses per round, e.g. 4)")
        return
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= MAX_SPECULATE:
        raise ServeError(
            f"speculate={k!r} must be an integer from 1 to {MAX_SPECULATE} (None: off)"
        )
    refuse_speculation(model, "target")
    if mesh is not None:
        raise ServeError("speculative decoding runs on one device; leave out the mesh or speculate")
    if decode_steps != 1:
        raise ServeError(
            f"decode_steps={decode_steps} and speculate={k} both set the tokens per decode "
            "call; keep decode_steps=1 when speculating"
        )
    if draft is None:
        return
    if not isinstance(draft, CausalLM):
        raise ServeError(f"draft must be an eqllm CausalLM, got {type(draft).__name__}")
    refuse_speculation(draft, "draft")
    vocab, draft_vocab = model.config.vocab_size, draft.config.vocab_size
    if draft_vocab != vocab:
        raise ServeError(
            f"the draft's vocab_size={draft_vocab} differs from the target's {vocab}; "
            "a draft must share the target's tokenizer"
        )
    if draft.config.max_seq_len < max_len:
        raise ServeError(
            f"the draft's context max_seq_len={draft.config.max_seq_len} is shorter than "
            f"max_len={max_len}; lower max_len or pick a draft with a longer context"
        )
