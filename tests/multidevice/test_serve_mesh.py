"""The serving engine on a tensor-parallel mesh answers as the single-device engine does (run by
tests/test_serve_mesh.py in its own process on 8 simulated devices)."""

from __future__ import annotations

import queue

import jax
import numpy as np
import pytest

import eqllm
from eqllm.generation.placement import serving_mesh
from eqllm.serve import Engine, Finished, Params, PromptScores, Token
from eqllm.sharding import MeshError
from tests.multidevice import CFG

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices"),
]

SLOTS, LENGTH, CHUNK = 4, 32, 16
PROMPTS = [[5, 17, 33], list(range(3, 23)), [90, 2], [7] * 9, [41, 8, 64, 12, 77], [1]]


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CFG, key=jax.random.key(0))


def _engine(model, mesh=None):
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, mesh=mesh)
    engine.warm()
    return engine


def _serve(engine):
    """Six requests at once on four slots (two wait for a free one): greedy, 8 tokens each, the
    first also scoring its prompt. (tokens, logprobs, prompt logprobs) per request."""
    runs = []
    for i, prompt in enumerate(PROMPTS):
        events = queue.Queue()
        params = Params(max_tokens=8, temperature=0, prompt_logprobs=i == 1)
        runs.append((engine.submit(prompt, params, events.put), events))
    for _ in range(500):  # bounded
        if engine.busy() == 0:
            break
        engine.step()
    out = []
    for _, events in runs:
        tokens, logprobs, scores, finished = [], [], [], None
        while not events.empty():
            event = events.get()
            if isinstance(event, Token):
                tokens.append(event.id)
                logprobs.append(event.logprob)
            elif isinstance(event, PromptScores):
                scores = event.logprobs[1:]
            elif isinstance(event, Finished):
                finished = event
        assert finished is not None and finished.reason == "length"
        out.append((tokens, logprobs, scores))
    return out


@pytest.fixture(scope="module")
def reference(model):
    return _serve(_engine(model))


@pytest.mark.parametrize("mesh_text", ["tensor=4", "data=2,tensor=4"])
def test_a_tensor_parallel_engine_answers_as_one_device_does(model, reference, mesh_text):
    compiles = []

    def count(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        mesh = serving_mesh(mesh_text)
        engine = _engine(model, mesh)
        assert compiles, "the listener sees the warm-up's compilations"
        compiles.clear()
        got = _serve(engine)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    data = mesh.shape["data"]
    # A quarter of each q projection and of the cached keys per device; the pool's positions
    # (and the slots) split by data.
    _, layers = engine.runner.weights
    assert layers[0].attn.q_proj.weight.addressable_shards[0].data.shape == (64 // 4, 64)
    keys = engine.runner.state.cache[0].data["k"]  # (pool positions, kv_heads, head_dim)
    rows = engine.kv_blocks * engine.block_size
    assert keys.addressable_shards[0].data.shape == (rows // data, 8 // 4, 8)
    assert compiles == []  # every shape was compiled by warm(); none per request
    for (tokens, logprobs, scores), (want_tokens, want_logprobs, want_scores) in zip(
        got, reference, strict=True
    ):
        assert tokens == want_tokens and len(tokens) == 8
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    assert engine.shapes()[0].endswith(f"on mesh data={data},tensor=4")


def test_meshes_that_do_not_fit_fail_clearly(model):
    with pytest.raises(MeshError, match="tensor=4 does not divide attention.n_kv_heads=2"):
        Engine(
            eqllm.CausalLM(CFG.replace(attention={"n_kv_heads": 2}), key=jax.random.key(0)),
            max_batch=4,
            mesh=serving_mesh("tensor=4"),
        )
    with pytest.raises(MeshError, match="data=2 does not divide max_batch=3"):
        Engine(model, max_batch=3, mesh=serving_mesh("data=2,tensor=2"))
    with pytest.raises(MeshError, match="needs 16 devices but 8 are available"):
        serving_mesh("tensor=16")
    with pytest.raises(MeshError, match="tensor and data only"):
        serving_mesh("fsdp=2")


def test_a_hybrid_serves_on_a_mesh_as_on_one_device():
    """qwen3_5's Gated DeltaNet layers split by head over `tensor`, and each slot's recurrent
    state (beside the attention pools) over `data` by slot: the same tokens, log-probabilities
    and prompt scores as one device."""
    from tests.families import TINY_CONFIGS

    model = eqllm.CausalLM(TINY_CONFIGS["qwen3_5"], key=jax.random.key(0))

    def engine(mesh=None):
        return Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, mesh=mesh)

    split = engine(serving_mesh("data=2,tensor=2"))
    got, want = _serve(split), _serve(engine())
    state = next(c for c in split.runner.state.cache if hasattr(c, "recurrent"))
    assert state.recurrent.addressable_shards[0].data.shape[0] == SLOTS // 2
    for (tokens, logprobs, scores), (want_tokens, want_logprobs, want_scores) in zip(
        got, want, strict=True
    ):
        assert tokens == want_tokens and len(tokens) == 8
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_mamba2_alone_serves_on_a_mesh_as_on_one_device():
    """A stack of Mamba-2 layers alone (no attention layer, so no pool): its heads split over
    `tensor`, each slot's SSM and convolution state over `data` by slot; the same tokens,
    log-probabilities and prompt scores as one device."""
    from tests.families import TINY_CONFIGS

    model = eqllm.CausalLM(TINY_CONFIGS["mamba2"], key=jax.random.key(0))

    def engine(mesh=None):
        return Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, mesh=mesh)

    split = engine(serving_mesh("data=2,tensor=2"))
    got, want = _serve(split), _serve(engine())
    state = split.runner.state.cache[0]
    assert state.ssm.addressable_shards[0].data.shape[0] == SLOTS // 2
    for (tokens, logprobs, scores), (want_tokens, want_logprobs, want_scores) in zip(
        got, want, strict=True
    ):
        assert tokens == want_tokens and len(tokens) == 8
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_falcon_h1_serves_on_a_mesh_as_on_one_device():
    """Falcon-H1's layers hold a pool and a Mamba-2 state each: the pool's keys and values split
    over `data` by row and `tensor` by kv head, the state over `data` by slot; the same tokens,
    log-probabilities and prompt scores as one device."""
    from tests.families import TINY_CONFIGS

    model = eqllm.CausalLM(TINY_CONFIGS["falcon_h1"], key=jax.random.key(0))

    def engine(mesh=None):
        return Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, mesh=mesh)

    split = engine(serving_mesh("data=2,tensor=2"))
    got, want = _serve(split), _serve(engine())
    pool, state = split.runner.state.cache[0]
    assert state.ssm.addressable_shards[0].data.shape[0] == SLOTS // 2
    assert pool.data["k"].addressable_shards[0].data.shape[1] == 1  # 2 kv heads over tensor=2
    for (tokens, logprobs, scores), (want_tokens, want_logprobs, want_scores) in zip(
        got, want, strict=True
    ):
        assert tokens == want_tokens and len(tokens) == 8
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)
