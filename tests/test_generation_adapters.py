"""Stacked LoRA adapters on the engine (`eqllm.generation.adapters`): rows of one batch, each
with its own adapter, equal each adapter's merged model run alone; nothing recompiles when the
mix of adapters changes; adapters of another base are refused."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm import lora, zoo
from eqllm.generation import Engine, Params, Token
from eqllm.generation.adapters import AdapterError, stack_adapters
from tests.tiny import TINY

PROMPTS = [np.arange(3, 40) % 97, np.arange(11, 19), np.arange(50, 61)]


def _random_b(model, seed: int):
    """`model` with non-zero B in every adapter (a fresh adapter computes the base)."""
    key = jax.random.key(seed)

    def fill(node):
        if not lora.is_lora(node):
            return node
        b = 0.3 * jax.random.normal(key, node.lora_b.weight.shape)
        return eqx.tree_at(lambda m: m.lora_b.weight, node, b)

    return jax.tree.map(fill, model, is_leaf=lora.is_lora)


@pytest.fixture(scope="module")
def models():
    base = zoo.create("llama-nano", key=jax.random.key(0), **TINY)
    one = lora.apply(base, rank=4, alpha=8, targets=["q_proj", "v_proj"], key=jax.random.key(1))
    two = lora.apply(
        base, rank=2, alpha=3, targets=["o_proj", "up_proj", "down_proj"], key=jax.random.key(2)
    )
    one, two = _random_b(one, 3), _random_b(two, 4)
    return base, stack_adapters(base, [one, two]), [base, lora.merge(one), lora.merge(two)]


def test_rows_with_different_adapters_equal_their_merged_models(models):
    _, stacked, merged = models
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))
    chosen = [1, 2, 0]
    for settings in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20}):
        got = eqllm.generate_batch(
            stacked, PROMPTS, max_new_tokens=8, key=keys, adapter=chosen, **settings
        )
        for i, (prompt, a) in enumerate(zip(PROMPTS, chosen, strict=True)):
            want = eqllm.generate(merged[a], prompt, max_new_tokens=8, key=keys[i], **settings)
            np.testing.assert_array_equal(got[i], want)
    base_out = eqllm.generate(merged[0], PROMPTS[0], max_new_tokens=8, key=keys[0], temperature=0)
    for a in (1, 2):  # the adapters change the output
        out = eqllm.generate(merged[a], PROMPTS[0], max_new_tokens=8, key=keys[0], temperature=0)
        assert not np.array_equal(out, base_out)


def test_a_new_mix_of_adapters_compiles_nothing(models):
    _, stacked, _ = models
    engine = Engine(stacked, max_batch=4, max_len=64, prefill_chunk=64)

    def run(adapters):
        out: list = []
        for prompt, a in zip(PROMPTS, adapters, strict=True):
            params = Params(max_tokens=4, temperature=0, adapter=a)
            engine.submit(prompt, params, lambda e: out.append(e) if isinstance(e, Token) else 0)
        engine.run(max_rounds=50)
        return out

    run([0, 1, 2])
    traces = dict(engine.runner.traces)
    run([2, 2, 1])
    assert engine.runner.traces == traces
    with pytest.raises(AdapterError, match="adapter=3"):
        engine.check(PROMPTS[0], Params(max_tokens=2, adapter=3))


def test_adapters_of_another_base_are_refused(models):
    base, *_ = models
    wider = zoo.create("llama-nano", key=jax.random.key(0), **{**TINY, "mlp.d_ff": 96})
    other = lora.apply(wider, rank=2, alpha=2, targets=["q_proj"], key=jax.random.key(1))
    with pytest.raises(AdapterError, match="'x': its base model's weight shapes differ"):
        stack_adapters(base, [other], ["x"])
    retrained = zoo.create("llama-nano", key=jax.random.key(5), **TINY)  # same shapes
    other = lora.apply(retrained, rank=2, alpha=2, targets=["q_proj"], key=jax.random.key(1))
    with pytest.raises(AdapterError, match="base weight at blocks.attn.q_proj differs"):
        stack_adapters(base, [other], ["x"])


@pytest.mark.slow  # three engines compiled: about a minute here
def test_speculation_verifies_each_row_with_its_adapter(models):
    """Prompt lookup and a draft (the base model, which holds no adapters) over rows of three
    adapters: greedy output equals plain decoding's, row by row. The base as draft guesses
    the base rows exactly and the adapted rows less well. (One engine shape for every run, so
    the runs share their compiled steps.)"""
    base, stacked, _ = models
    prompts = [[int(t) for t in p[:10]] * 2 for p in PROMPTS] + [[5, 6, 7, 8] * 4]  # repeats

    def run(chosen, **speculation):
        engine = Engine(stacked, max_batch=4, max_len=64, prefill_chunk=64, **speculation)
        out = [[] for _ in prompts]
        for prompt, a, tokens in zip(prompts, chosen, out, strict=True):
            sink = functools.partial(
                lambda t, e: t.append(e.id) if isinstance(e, Token) else 0, tokens
            )
            engine.submit(prompt, Params(max_tokens=12, temperature=0, adapter=a), sink)
        engine.run(max_rounds=100)
        return out, engine.stats().get("speculative_acceptance")

    chosen = [1, 2, 0, 2]
    plain, _ = run(chosen)
    assert run(chosen, speculate=3)[0] == plain
    assert run(chosen, speculate=3, draft=base)[0] == plain
    assert run([0] * 4, speculate=3, draft=base)[1] == 1.0
    assert run([1] * 4, speculate=3, draft=base)[1] < 1.0
