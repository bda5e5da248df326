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


def check_chunked_prefill(model, engine, length: int) -> None:
    """50 prompt tokens as four chunks of 16 (the last one left-padded) and as one chunk of 64,
    on `engine(prefill_chunk=...)`s: the same tokens and log-probabilities, and those of the
    full forward."""
    [prompt] = random_prompts([50], seed=1)
    calls, out = [], []
    for chunk in (16, 64):
        e = engine(prefill_chunk=chunk)
        e.runner.prefill = counted(e.runner.prefill, calls, chunk)
        out.append(run_requests(e, [(prompt, 8, 7)])[0])
    assert calls.count(16) == 4 and calls.count(64) == 1
    assert out[0][0] == out[1][0]
    np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-5, rtol=0)
    [full] = full_forward_logprobs(model, [prompt], [out[0][0]], length)
    np.testing.assert_allclose(out[0][1], full, atol=1e-4, rtol=0)
