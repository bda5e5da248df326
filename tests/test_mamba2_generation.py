"""Generation of Mamba-2 models on the one engine: a stack of Mamba-2 layers alone (`mamba2`: no
attention layer, so no KV pool at all) and a hybrid of Mamba-2 and attention layers. Each slot's
SSM and convolution state sits in the engine's cache as a Gated DeltaNet's does
(`eqllm.generation.recurrent`), carried across prefill chunks and decode steps, and cleared
before a slot serves its next request.

References: the full forward (logits of the whole sequence at once, an independent path: no
cache, the chunked scan over every token) and `eqllm.generate` on a fresh engine per request.
The family contract (tests/test_families.py) checks the stack's cached decoding against the
full forward and greedy `eqllm.generate` against transformers' `Mamba2ForCausalLM.generate`.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.errors import EqllmError
from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.requests import ServeError
from eqllm.generation.sizing import request_bytes
from eqllm.serve import Engine
from tests.conftest import cached_logits
from tests.engine_runs import (
    check_chunked_prefill,
    full_forward_logprobs,
    random_prompts,
    run_requests,
)
from tests.families import TINY_CONFIGS

LENGTH, SLOTS, CHUNK = 64, 2, 16  # every engine here but two has these sizes: shared shapes
PURE = TINY_CONFIGS["mamba2"]  # two Mamba-2 layers of 8 heads of 8, 2 groups, a state of 8
# Mamba-2 layers with MLPs between attention layers (Nemotron-H's and Granite 4.0-H's layout).
HYBRID = PURE.replace(
    n_layers=4, attention={"n_heads": 4}, mlp={"d_ff": 64}, linear={"full_every": 2, "mlp": True}
)


def _perturbed(model, key):
    """`model` with N(0, 0.3) added to every floating parameter: its next-token distributions
    are far from uniform, so a wrong state shows in the tokens and their log-probabilities."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


@pytest.fixture(scope="module")
def models(twins):
    """The family contract's perturbed tiny `mamba2` (transformers' twin), and the hybrid."""

    class Lazy(dict):
        def __missing__(self, name):
            if name == "mamba2":
                self[name] = twins("mamba2").model
            else:
                hybrid = eqllm.CausalLM(HYBRID, key=jax.random.key(3))
                self[name] = _perturbed(hybrid, jax.random.key(4))
            return self[name]

    return Lazy()


def _engine(model, **changes):
    return Engine(
        model, **{"max_batch": SLOTS, "max_len": LENGTH, "prefill_chunk": CHUNK, **changes}
    )


def test_cached_decoding_of_a_hybrid_equals_the_full_forward(models):
    """Prefill 20 tokens, then one at a time: the Mamba-2 layers carry their state, the
    attention layers their keys and values, and each step's logits are the full forward's."""
    model = models["hybrid"]
    tokens = np.random.default_rng(5).integers(0, 97, LENGTH)
    full = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(cached_logits(model, tokens, 20), full[19:-1], atol=2e-5, rtol=0)


# The hybrid's engine path is the Gated DeltaNet hybrids' (tests/test_hybrid_generation.py).
@pytest.mark.parametrize("name", ["mamba2", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_slots_joining_and_leaving_equal_generate_and_the_full_forward(models, name):
    """Five sampled requests over two slots: prompts of one to three chunks prefilled while
    the other slot decodes, requests leaving after 3 to 14 tokens and others taking their
    slot. Each equals `eqllm.generate` (row i of `generate_batch` with key i: its engine takes
    every prompt in one left-padded prefill call), and its log-probabilities the full
    forward's."""
    model = models[name]
    prompts = random_prompts([5, 37, 12, 20, 3])
    new = [9, 4, 14, 6, 11]
    got = run_requests(
        _engine(model), [(p, n, i) for i, (p, n) in enumerate(zip(prompts, new, strict=True))]
    )
    keys = jax.vmap(jax.random.key)(np.arange(len(prompts)))
    want = eqllm.generate_batch(model, prompts, max_new_tokens=max(new), key=keys)
    assert [tokens for tokens, _ in got] == [w[:n].tolist() for w, n in zip(want, new, strict=True)]
    full = full_forward_logprobs(model, prompts, [tokens for tokens, _ in got], LENGTH)
    for (_, logprobs), wanted in zip(got, full, strict=True):
        np.testing.assert_allclose(logprobs, wanted, atol=1e-4, rtol=0)


def test_a_left_padded_batch_equals_each_prompt_alone(models):
    """`generate_batch` left-pads prompts of 3, 10 and 1 tokens into one prefill call: the
    padding neither reads nor changes a row's state, so each row is its prompt alone (greedy,
    and sampled with its key)."""
    model = models["mamba2"]
    batch = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
    keys = jax.random.split(jax.random.key(7), len(batch))
    for kw in ({"temperature": 0}, {"top_k": 20}):
        rows = eqllm.generate_batch(model, batch, max_new_tokens=12, key=keys, **kw)
        for prompt, key, row in zip(batch, keys, rows, strict=True):
            alone = eqllm.generate(model, prompt, max_new_tokens=12, key=key, **kw)
            assert row.tolist() == alone.tolist()


def test_a_prompt_in_several_chunks_equals_one_prefill(models):
    """50 prompt tokens as four chunks of 16 (the state carried from chunk to chunk, the last
    one left-padded) and as one chunk of 64: the same tokens and log-probabilities."""
    model = models["mamba2"]
    check_chunked_prefill(model, functools.partial(_engine, model), LENGTH)


def test_a_reused_slot_starts_from_a_cleared_state(models):
    """One slot serves a request, then another: the second's output is a fresh engine's."""
    model = models["mamba2"]
    first, second = random_prompts([30, 9], seed=2)
    engine = _engine(model)
    run_requests(engine, [(first, 12, 3)])
    states = engine.runner.state.cache
    assert len(states) == 2 and all(np.any(np.asarray(s.ssm[0]) != 0) for s in states)
    reused = run_requests(engine, [(second, 10, 4)])
    assert reused == run_requests(_engine(model), [(second, 10, 4)])


def test_the_cache_holds_each_slot_s_state_and_no_pool_without_attention():
    """Bytes per request in closed form: a Mamba-2 layer's conv inputs (kernel - 1 rows of x, B
    and C) and its state (heads x head_dim x d_state, fp32), the same at any length; the
    hybrid's attention layers add K and V per position. Without attention layers the pool
    holds no bytes: every slot gets its pages at full length, once the budget holds every
    slot's state."""
    lin = PURE.linear
    conv = (lin.conv_kernel - 1) * (lin.n_value_heads * lin.value_head_dim + 2 * 2 * 8) * 4
    state = conv + lin.n_value_heads * lin.value_head_dim * lin.key_head_dim * 4
    pure, hybrid = (
        eqx.filter_eval_shape(eqllm.CausalLM, c, key=jax.random.key(0)) for c in (PURE, HYBRID)
    )
    assert bytes_per_token(pure) == 0 and state_bytes(pure) == 2 * state
    assert request_bytes(pure, 40) == request_bytes(pure, 4000) == 2 * state
    kv = 2 * HYBRID.attention.n_kv_heads * HYBRID.head_dim * 4  # K and V, one layer, one position
    assert bytes_per_token(hybrid) == 2 * kv and state_bytes(hybrid) == 2 * state
    assert request_bytes(hybrid, 40) == 48 * 2 * kv + 2 * state  # three blocks of 16
    model = eqllm.CausalLM(PURE, key=jax.random.key(0))
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, kv_memory=SLOTS * 2 * state)
    assert engine.kv_blocks == SLOTS * LENGTH // 16 and engine.kv_bytes == 0
    assert "recurrent state" in engine.describe() and "prefix cache off" in engine.describe()
    with pytest.raises(ServeError, match="recurrent state of max_batch=2 slots"):
        Engine(model, max_batch=SLOTS, max_len=LENGTH, kv_memory=2 * state)


def test_speculative_decoding_refuses_a_state_space_model():
    """Rejected guesses would have to be undone in the state, which the engine does not keep."""
    model = eqllm.CausalLM(PURE, key=jax.random.key(0))
    with pytest.raises(EqllmError, match="state-space target .* without --speculate"):
        Engine(model, max_batch=SLOTS, max_len=LENGTH, speculate=2)
