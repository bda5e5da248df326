"""Generation of Falcon-H1 on the one engine: every layer runs attention and Mamba-2 side by side,
so each layer's cache entry is the pair (its paged KV pool, each slot's Mamba-2 state), the
pool's blocks written as any attention layer's and the state carried across prefill chunks and
decode steps, untouched by left padding and cleared before a slot serves its next request.

References: the full forward (logits of the whole sequence at once: no cache, the chunked scan
over every token) and `eqllm.generate` on a fresh engine per request. The family contract
(tests/test_families.py) checks cached decoding against the full forward and greedy
`eqllm.generate` against transformers' `FalconH1ForCausalLM.generate`.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.errors import EqllmError
from eqllm.generation.paged import Pool, bytes_per_token, state_bytes
from eqllm.generation.sizing import request_bytes
from eqllm.nn import KVCache, Mamba2State
from eqllm.serve import Engine
from tests.engine_runs import (
    check_chunked_prefill,
    full_forward_logprobs,
    random_prompts,
    run_requests,
)
from tests.families import TINY_CONFIGS

LENGTH, SLOTS, CHUNK = 64, 2, 16  # every engine here but two has these sizes: shared shapes
CONFIG = TINY_CONFIGS["falcon_h1"]  # two layers, each attention (2 kv heads of 8) and Mamba-2


@pytest.fixture(scope="module")
def model(twins):
    """The family contract's perturbed tiny Falcon-H1 (transformers' twin's import), every muP
    multiplier away from 1."""
    return twins("falcon_h1").model


def _engine(model, **changes):
    return Engine(
        model, **{"max_batch": SLOTS, "max_len": LENGTH, "prefill_chunk": CHUNK, **changes}
    )


def test_a_layer_s_cache_is_its_kv_cache_and_its_mixer_s_state(model):
    cache = model.init_cache(LENGTH)
    assert len(cache) == CONFIG.n_layers
    for kv, state in cache:
        assert isinstance(kv, KVCache) and isinstance(state, Mamba2State)
        assert kv.positions.shape == (LENGTH,) and state.ssm.dtype == np.float32


def test_slots_joining_and_leaving_equal_generate_and_the_full_forward(model):
    """Five sampled requests over two slots: prompts of one to three chunks prefilled while
    the other slot decodes, requests leaving after 3 to 14 tokens and others taking their
    slot. Each equals `eqllm.generate` (row i of `generate_batch` with key i: its engine takes
    every prompt in one left-padded prefill call), and its log-probabilities the full
    forward's."""
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


@pytest.mark.slow  # the test above runs generate_batch's left-padded prefill by default
def test_a_left_padded_batch_equals_each_prompt_alone(model):
    """`generate_batch` left-pads prompts of 3, 10 and 1 tokens into one prefill call: the
    padding is neither cached nor attended to, and neither reads nor changes a row's state."""
    batch = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
    keys = jax.random.split(jax.random.key(7), len(batch))
    rows = eqllm.generate_batch(model, batch, max_new_tokens=12, key=keys, top_k=20)
    for prompt, key, row in zip(batch, keys, rows, strict=True):
        alone = eqllm.generate(model, prompt, max_new_tokens=12, key=key, top_k=20)
        assert row.tolist() == alone.tolist()


def test_a_prompt_in_several_chunks_equals_one_prefill(model):
    """50 prompt tokens as four chunks of 16 (the KV blocks and the state carried from chunk to
    chunk, the last one left-padded) and as one chunk of 64: the same tokens and
    log-probabilities, and those the full forward's."""
    check_chunked_prefill(model, functools.partial(_engine, model), LENGTH)


def test_a_reused_slot_starts_from_a_cleared_state(model):
    """One slot serves a request, then another: the second's output is a fresh engine's, though
    the first left its state (and its keys and values) behind."""
    first, second = random_prompts([30, 9], seed=2)
    engine = _engine(model)
    run_requests(engine, [(first, 12, 3)])
    cache = engine.runner.state.cache
    assert len(cache) == CONFIG.n_layers
    for pool, state in cache:
        assert isinstance(pool, Pool) and np.any(np.asarray(pool.data["k"]) != 0)
        assert np.any(np.asarray(state.ssm[0]) != 0)
    reused = run_requests(engine, [(second, 10, 4)])
    assert reused == run_requests(_engine(model), [(second, 10, 4)])


def test_the_cache_holds_kv_per_position_and_the_state_per_request():
    """Bytes per request in closed form: every layer's K and V per position (as the same model
    with attention alone) plus every layer's Mamba-2 state (conv inputs of x, B and C; the SSM
    state in fp32), the same at any length; the budget pays for every slot's state first."""
    a, lin = CONFIG.attention, CONFIG.linear
    kv = 2 * a.n_kv_heads * CONFIG.head_dim * 4  # K and V, one layer, one position, fp32
    inner = lin.n_value_heads * lin.value_head_dim
    conv = (lin.conv_kernel - 1) * (inner + 2 * lin.n_key_heads * lin.key_head_dim) * 4
    state = conv + inner * lin.key_head_dim * 4
    falcon, attention = (
        eqx.filter_eval_shape(eqllm.CausalLM, c, key=jax.random.key(0))
        for c in (CONFIG, CONFIG.replace(linear=None, multipliers=None))
    )
    assert bytes_per_token(falcon) == bytes_per_token(attention) == 2 * kv
    assert state_bytes(falcon) == 2 * state and state_bytes(attention) == 0
    assert request_bytes(falcon, 40) == 48 * 2 * kv + 2 * state  # three blocks of 16
    assert request_bytes(falcon, 40) - request_bytes(attention, 40) == 2 * state
    model = eqllm.CausalLM(CONFIG, key=jax.random.key(0))
    block = 16 * bytes_per_token(model)
    budget = SLOTS * state_bytes(model) + 4 * block + block // 2
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, kv_memory=budget)
    assert engine.kv_blocks == 4  # 5 had the slots' state not been paid for
    assert not engine.pool.prefix_cache and "recurrent state" in engine.describe()


def test_the_server_s_seeded_completion_equals_generate(model):
    """`eqllm serve`'s app over the engine (no tokenizer: token ids in, ids as text out): a
    seeded sampled completion is `eqllm.generate`'s with that seed."""
    from eqllm.serve.app import Service, create_app
    from tests.serve_helpers import ServerThread, post

    prompt = random_prompts([11], seed=3)[0]
    service = Service(_engine(model), None, model_name="falcon")
    body = {"model": "falcon", "prompt": " ".join(map(str, prompt)), "max_tokens": 10}
    with ServerThread(create_app(service)) as server:
        status, out = post(f"{server.url}/v1/completions", {**body, "seed": 5, "top_k": 20})
    assert status == 200, out
    want = eqllm.generate(model, prompt, max_new_tokens=10, key=jax.random.key(5), top_k=20)
    assert [int(t) for t in out["choices"][0]["text"].split()] == want.tolist()


def test_speculative_decoding_refuses_falcon_h1():
    """Rejected guesses would have to be undone in the Mamba-2 state, which the engine does not
    keep per guess."""
    model = eqllm.CausalLM(CONFIG, key=jax.random.key(0))
    with pytest.raises(EqllmError, match="hybrid target .*falcon_h1.* without --speculate"):
        Engine(model, max_batch=SLOTS, max_len=LENGTH, speculate=2)
