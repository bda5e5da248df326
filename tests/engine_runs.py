"""What the engine tests over recurrent models share: requests run to the end on an engine,
their log-probabilities by the full forward, counted prefill calls, random prompts."""

from __future__ import annotations

import queue

import jax
import jax.numpy as jnp
import numpy as np

from eqllm.serve import Finished, Params, Token


def run_requests(engine, requests) -> list[tuple[list[int], list[float]]]:
    """Submit (prompt, max_tokens, seed) each, step until done; (tokens, logprobs) per request."""
    runs = []
    for prompt, max_tokens, seed in requests:
        events = queue.Queue()
        params = Params(max_tokens=max_tokens, seed=seed, temperature=1.0)
        engine.submit(prompt, params, events.put)
        runs.append(events)
    engine.run(2000)
    out = []
    for events in runs:
        tokens, logprobs, reason = [], [], None
        while not events.empty():
            event = events.get()
            if isinstance(event, Token):
                tokens.append(event.id)
                logprobs.append(event.logprob)
            elif isinstance(event, Finished):
                reason = event.reason
        assert reason == "length"
        out.append((tokens, logprobs))
    return out


def full_forward_logprobs(model, prompts, outputs, length: int) -> list[list[float]]:
    """Each output token's log-probability by the full forward over prompt + output (all of
    them in one batch, right-padded to `length`: causal, so the padding changes no earlier
    row)."""
    rows = np.zeros((len(prompts), length), np.int32)
    for row, prompt, tokens in zip(rows, prompts, outputs, strict=True):
        row[: len(prompt) + len(tokens)] = [*prompt, *tokens]
    logprobs = np.asarray(jax.nn.log_softmax(model(jnp.asarray(rows)), axis=-1))
    return [
        [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]
        for lp, prompt, tokens in zip(logprobs, prompts, outputs, strict=True)
    ]


def counted(prefill, calls: list, tag):
    """`prefill` that appends `tag` to `calls` at each call."""

    def call(*args):
        calls.append(tag)
        return prefill(*args)

    return call


def random_prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, n).tolist() for n in lengths]
