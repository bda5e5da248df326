"""Stacked LoRA adapters on a serving mesh answer as on one device, with A and B split as their
base weights are (run by tests/test_serve_mesh.py in its own process on 8 simulated devices)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.generation.adapters import stack_adapters
from eqllm.generation.placement import serving_mesh
from eqllm.serve import Engine, Params, Token
from tests.multidevice import CFG

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices"),
]

PROMPTS = [[5, 17, 33], list(range(3, 23)), [90, 2], [7] * 9, [41, 8, 64, 12, 77]]
CHOSEN = [1, 2, 0, 2, 1]


def _adapted(base, seed: int, **settings):
    model = lora.apply(base, key=jax.random.key(seed), **settings)

    def fill(node):  # a non-zero B (a fresh adapter computes the base)
        if not lora.is_lora(node):
            return node
        b = 0.3 * jax.random.normal(jax.random.key(seed + 10), node.lora_b.weight.shape)
        return eqx.tree_at(lambda m: m.lora_b.weight, node, b)

    return jax.tree.map(fill, model, is_leaf=lora.is_lora)


def _serve(engine):
    """Every prompt with its adapter, greedy, 6 tokens: (tokens, logprobs) per request."""
    events = [[] for _ in PROMPTS]
    for prompt, adapter, out in zip(PROMPTS, CHOSEN, events, strict=True):
        engine.submit(prompt, Params(max_tokens=6, temperature=0, adapter=adapter), out.append)
    engine.run(max_rounds=200)
    return [
        (
            [e.id for e in out if isinstance(e, Token)],
            [e.logprob for e in out if isinstance(e, Token)],
        )
        for out in events
    ]


def test_adapters_on_a_mesh_answer_as_on_one_device():
    base = eqllm.CausalLM(CFG, key=jax.random.key(0))
    one = _adapted(base, 1, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    two = _adapted(base, 2, rank=2, alpha=3, targets=["o_proj", "up_proj", "down_proj"])
    stacked = stack_adapters(base, [one, two])

    def engine(mesh=None):
        return Engine(stacked, max_batch=4, max_len=32, prefill_chunk=16, mesh=mesh)

    want = _serve(engine())
    split = engine(serving_mesh("data=2,tensor=4"))
    got = _serve(split)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens and len(tokens) == 6
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
    # q (column-parallel): B's output split over tensor=4 like q's heads (64 -> 16); o
    # (row-parallel): A's input split like o's (64 -> 16); the adapter and rank axes whole.
    _, layers = split.runner.weights
    q, o = layers[0].attn.q_proj, layers[0].attn.o_proj
    assert q.b.shape == (3, 4, 64) and q.b.addressable_shards[0].data.shape == (3, 4, 16)
    assert q.a.addressable_shards[0].data.shape == (3, 64, 4)
    assert o.a.shape == (3, 64, 2) and o.a.addressable_shards[0].data.shape == (3, 16, 2)
    assert o.b.addressable_shards[0].data.shape == (3, 2, 64)
