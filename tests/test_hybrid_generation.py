"""Generation of a hybrid (`qwen3_5`: Gated DeltaNet and attention layers) on the one engine:
each slot's recurrent state sits beside the attention layers' paged pools, is carried across
prefill chunks and decode steps, and is cleared before a slot serves its next request.

References: the full forward (logits of the whole sequence at once, an independent path: no
cache, chunked delta rule over every token) and `eqllm.generate` on a fresh engine per request.
The family contract (tests/test_families.py) checks cached decoding against the full forward
and greedy `eqllm.generate` against transformers' `generate`.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.sizing import request_bytes
from eqllm.serve import Engine
from tests.engine_runs import (
    check_chunked_prefill,
    full_forward_logprobs,
    random_prompts,
    run_requests,
)
from tests.families import TINY_CONFIGS

LENGTH, SLOTS = 64, 2  # every engine here but one has these sizes: they share compiled shapes


@pytest.fixture(scope="module")
def model(twins):
    """The perturbed tiny qwen3_5 the family contract uses: its next-token distributions are
    far from uniform, so a wrong state shows in the tokens and their log-probabilities."""
    return twins("qwen3_5").model


def test_slots_joining_and_leaving_equal_generate_and_the_full_forward(model):
    """Five sampled requests over two slots: prompts of one to three chunks prefilled while
    the other slot decodes, requests leaving after 3 to 14 tokens and others taking their
    slot. Each equals `eqllm.generate` (row i of `generate_batch` with key i; a shorter
    output is a prefix of a longer one), whose engine takes every prompt in one prefill call,
    and its log-probabilities the full forward's."""
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=16)
    prompts = random_prompts([5, 37, 12, 20, 3])
    new = [9, 4, 14, 6, 11]
    got = run_requests(
        engine, [(p, n, i) for i, (p, n) in enumerate(zip(prompts, new, strict=True))]
    )
    keys = jax.vmap(jax.random.key)(np.arange(len(prompts)))
    want = eqllm.generate_batch(model, prompts, max_new_tokens=max(new), key=keys)
    assert [tokens for tokens, _ in got] == [w[:n].tolist() for w, n in zip(want, new, strict=True)]
    full = full_forward_logprobs(model, prompts, [tokens for tokens, _ in got], LENGTH)
    for (_, logprobs), wanted in zip(got, full, strict=True):
        np.testing.assert_allclose(logprobs, wanted, atol=1e-4, rtol=0)


@pytest.mark.slow  # its own shapes; the default test above compares chunks with one call too
def test_a_prompt_in_several_chunks_equals_one_prefill(model):
    """50 prompt tokens as four chunks of 16 (the state carried from chunk to chunk, the last
    one left-padded) and as one chunk of 64: the same tokens and log-probabilities."""
    engine = functools.partial(Engine, model, max_batch=SLOTS, max_len=LENGTH)
    check_chunked_prefill(model, engine, LENGTH)


def test_a_reused_slot_starts_from_a_cleared_state(model):
    """One slot serves a request, then another: the second's output is a fresh engine's."""
    first, second = random_prompts([30, 9], seed=2)
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=16)
    run_requests(engine, [(first, 12, 3)])
    states = [c for c in engine.runner.state.cache if hasattr(c, "recurrent")]
    assert len(states) == 2 and all(np.any(np.asarray(s.recurrent[0]) != 0) for s in states)
    reused = run_requests(engine, [(second, 10, 4)])
    fresh = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=16)
    assert reused == run_requests(fresh, [(second, 10, 4)])


def test_the_cache_holds_the_state_per_slot_and_no_prefix_reuse(model):
    """Bytes per request in closed form: the attention layers' K and V per position plus the
    linear layers' fixed state, against every layer caching K and V; the pool's budget pays
    for every slot's state first; prefix reuse is off (a found prefix would lack its state)."""
    config = TINY_CONFIGS["qwen3_5"]  # linear, full, linear, full; fp32
    a, lin = config.attention, config.linear
    kv = 2 * a.n_kv_heads * config.head_dim * 4  # K and V of one layer, one position
    conv = (lin.conv_kernel - 1) * (2 * lin.n_key_heads * lin.key_head_dim + lin.n_value_heads * 8)
    state = (conv + lin.n_value_heads * lin.key_head_dim * lin.value_head_dim) * 4
    hybrid, full = (
        eqx.filter_eval_shape(eqllm.CausalLM, c, key=jax.random.key(0))
        for c in (config, config.replace(linear=None))
    )
    assert bytes_per_token(hybrid) == 2 * kv and state_bytes(hybrid) == 2 * state
    assert request_bytes(hybrid, 40) == 48 * 2 * kv + 2 * state  # three blocks of 16
    assert request_bytes(full, 40) == 48 * 4 * kv and state_bytes(full) == 0
    block = 16 * bytes_per_token(model)
    budget = 2 * state_bytes(model) + 4 * block + block // 2
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, kv_memory=budget)
    assert engine.kv_blocks == 4  # 5 had the slots' state not been paid for
    assert not engine.pool.prefix_cache and "prefix cache off" in engine.describe()


def test_layers_slice_both_stacks_in_layer_order_and_restack(model):
    """`layers()` (what the engine keeps) interleaves the two stacks as the layers run, and
    `with_layers` (the engine's prompt scores) rebuilds both stacks from them."""
    layers = model.layers()
    kinds = ["linear" if hasattr(block.attn, "A_log") else "full" for block in layers]
    assert tuple(kinds) == model.config.layer_kinds()
    np.testing.assert_array_equal(layers[2].attn.A_log, model.linear_blocks.attn.A_log[1])
    again = model.without_stacks().with_layers(layers)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)
