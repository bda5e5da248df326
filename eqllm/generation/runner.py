"""The engine's device side: the state on device (the paged pools and every slot's arrays), the
compiled steps and the weights they run on, and the host arrays each call is built from.

The scheduling (which requests, how many positions, which shape) is the engine's; a call here
lays its requests out in the rows of one compiled step (`eqllm.generation.steps`) and returns
what the step sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eqllm.generation import adapters
from eqllm.generation.constrain import all_allowed
from eqllm.generation.placement import state_shardings
from eqllm.generation.requests import PromptScores, Request
from eqllm.generation.sampling import Sampling, sampling
from eqllm.generation.settings import RowSettings
from eqllm.generation.steps import TRACES, compiled, empty_state
from eqllm.model import CausalLM


class Runner:
    """The device state of `max_batch` slots over a pool of `blocks` blocks of `block_size`
    positions, and the compiled steps on `model` (split over `mesh`, if given).

    `steps` are the compiled steps, bound to their weights; `weights` the weights as placed
    (model without its blocks, sliced layers); `traces` how often each step was traced for
    this runner (a test checks that nothing recompiles); `adapters` how many LoRA adapters the
    model holds (`eqllm.generation.adapters`; each call then passes every row's).
    """

    def __init__(
        self, model: CausalLM, mesh: Mesh | None, max_batch: int, blocks: int, block_size: int
    ):
        self.vocab, self.max_batch, self.block_size = (
            model.config.vocab_size,
            max_batch,
            block_size,
        )
        self.traces: dict[str, int] = {}
        self.adapters = adapters.count(model)
        self.draft: Runner | None = None  # a draft model's runner: prefills what this one does
        steps, self.weights = compiled(model, mesh)
        self.steps = {name: self._counted(name, fn) for name, fn in steps.items()}
        self._empty = lambda: empty_state(model, max_batch, blocks, block_size)
        self._mesh = mesh
        self.clear()

    def clear(self) -> None:
        """Every slot empty and every pool zero (placed on the mesh)."""
        self.state = None  # freed before the new pools are made
        state = self._empty()
        self.state = (
            state
            if self._mesh is None
            else jax.device_put(state, state_shardings(state, self._mesh))
        )

    def _counted(self, name: str, fn):
        def call(*args, **sizes):
            before = TRACES.get(name, 0)
            out = fn(*args, **sizes)
            if TRACES.get(name, 0) != before:
                self.traces[name] = self.traces.get(name, 0) + TRACES[name] - before
            return out

        return call

    def prefill(self, chunks: list[tuple[Request, int]], width: int, rows: int, pages: int) -> list:
        """One prefill call: the next `n` positions of each (request, n), left-padded to
        `width`, in `rows` rows (the rest padding), over views of `pages` pages; per request,
        its next token (token, logprob, top alternatives) once its sequence is in, else None.
        Each request's cursor moves past its chunk."""
        slots = np.full(rows, self.max_batch, np.int32)  # out of range: padding, not written
        table = np.zeros((rows, pages), np.int32)
        tokens = np.zeros((rows, width), np.int32)
        positions = np.full((rows, width), -1, np.int32)
        first, last = np.zeros(rows, bool), np.zeros(rows, bool)
        step = np.zeros(rows, np.int32)
        seen = np.zeros((rows, self.vocab), bool)
        keys = [jax.random.key(0)] * rows
        settings = RowSettings(rows)
        allowed = all_allowed(rows, self.vocab)
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
            if last[i] and request.constraint is not None:
                request.constraint.fill(allowed[i])
            keys[i] = request.key
            settings.set(
                i, sampling(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)
            )
        top = any(r.params.logprobs for r, _ in chunks)
        args = (slots, table, tokens, positions, first, last, jnp.stack(keys), step, seen)
        args = (*args, settings.stacked(), np.asarray(top), allowed)
        if self.adapters:
            args = (*args, self._adapters([r for r, _ in chunks], rows))
        self.state, out = self.steps["prefill"](self.state, *args, block_size=self.block_size)
        if self.draft is not None:  # the draft's pools hold every position the target's do
            self.draft.state, _ = self.draft.steps["prefill"](
                self.draft.state, *args, block_size=self.block_size
            )
        if not last.any():
            return [None] * len(chunks)
        out = jax.device_get(out)
        return [
            (
                int(out.token[i]),
                float(out.logprob[i]),
                top_alternatives(out.top_tokens[i], out.top_logprobs[i]),
            )
            if last[i]
            else None
            for i in range(len(chunks))
        ]

    def decode(
        self,
        requests: Sequence[Request | None],
        active: np.ndarray,
        pages: int,
        steps: int,
        settings: Sampling,
        stops: np.ndarray,
    ):
        """One decode call of `steps` tokens for the `active` rows of the first `len(active)`
        slots (`requests` by slot, with their sampling `settings` and `stop` ids), over views of
        `pages` pages; what it sampled, on the host."""
        slots = len(active)
        table = np.zeros((slots, pages), np.int32)
        remaining = np.zeros(slots, np.int32)
        allowed = all_allowed(slots, self.vocab)
        top = False
        for row in np.flatnonzero(active):
            request = requests[row]
            table[row, : min(len(request.blocks), pages)] = request.blocks[:pages]
            remaining[row] = request.params.max_tokens - request.produced
            top |= request.params.logprobs
            if request.constraint is not None:
                request.constraint.fill(allowed[row])
        chosen = self._adapters([requests[r] for r in np.flatnonzero(active)], slots, active)
        self.state, out = self.steps["decode"](
            self.state,
            table,
            active,
            remaining,
            stops,
            settings,
            np.asarray(top),
            allowed,
            chosen if self.adapters else None,
            slots=slots,
            steps=steps,
            block_size=self.block_size,
        )
        return jax.device_get(out)

    def warm_decode(self, slots: int, pages: int, steps: int, settings: Sampling, stops) -> None:
        """Run a decode shape with every slot live (over block 0: `clear` after). A call with no
        slot live skips the step's loop, and XLA:CPU then pays on the first real call for code
        that never ran: 0.7 s for smollm-135m's 16-slot step, measured."""
        self.state, _ = self.steps["decode"](
            self.state,
            np.zeros((slots, pages), np.int32),
            np.ones(slots, bool),
            np.full(slots, steps, np.int32),
            stops,
            settings,
            np.asarray(True),
            all_allowed(slots, self.vocab),
            np.zeros(slots, np.int32) if self.adapters else None,
            slots=slots,
            steps=steps,
            block_size=self.block_size,
        )
        jax.block_until_ready(self.state)

    def _adapters(self, requests: list[Request], rows: int, where=None) -> np.ndarray:
        """Each row's adapter index (0: none): `requests` fill the first rows, or those that
        `where` marks."""
        out = np.zeros(rows, np.int32)
        places = range(len(requests)) if where is None else np.flatnonzero(where)
        for row, request in zip(places, requests, strict=True):
            out[row] = request.params.adapter
        return out

    def score(self, prompt: np.ndarray, width: int, adapter: int = 0) -> PromptScores:
        """Every prompt token's log-probability after the ones before it (and the most likely
        alternatives there), the prompt right-padded to `width`, under LoRA `adapter`."""
        tokens = np.zeros(width, np.int32)  # right-padded
        tokens[: len(prompt)] = prompt
        index = np.asarray(adapter, np.int32) if self.adapters else None
        out = jax.device_get(self.steps["score"](tokens, index))
        n = len(prompt) - 1
        tops = [top_alternatives(out.top_tokens[i], out.top_logprobs[i]) for i in range(n)]
        return PromptScores((None, *out.logprob[:n].tolist()), (None, *tops))


def top_alternatives(tokens: np.ndarray, logprobs: np.ndarray) -> tuple:
    """(token, logprob) pairs of a step's most likely alternatives."""
    return tuple(zip(tokens.tolist(), logprobs.tolist(), strict=True))
