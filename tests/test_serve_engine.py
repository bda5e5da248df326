"""The continuous-batching engine on a tiny model: seeded requests equal `eqllm.generate` alone
or among 30 others; requests join and leave between steps and reuse slots; long prompts are
prefilled in chunks between decode steps, a chunk of each waiting prompt while they outnumber
the decoding requests; stop tokens, max_tokens and the queue bound hold; and
nothing is traced again after the warm-up."""

from __future__ import annotations

import queue
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS

import eqllm
from eqllm.generation import paged, runner, sizing, steps
from eqllm.generation.constrain import all_allowed
from eqllm.generation.pages import BlockPool, block_hashes
from eqllm.generation.settings import RowSettings
from eqllm.serve import Engine, Finished, Params, PromptScores, QueueFull, ServeError, Token

SLOTS, LENGTH, CHUNK = 4, 64, 16


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(3))


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, max_queue=64)
    engine.warm()
    return engine


def _submit(engine, prompt, **params):
    events = queue.Queue()
    return engine.submit(prompt, Params(**params), events.put), events


def _drain(engine, runs, max_steps=2000):
    """Step the engine (no thread) until every run finished; (tokens, reason) per run."""
    for _ in range(max_steps):
        if engine.busy() == 0:
            break
        engine.step()
    out = []
    for _, events in runs:
        tokens, reason = [], None
        while not events.empty():
            event = events.get()
            if isinstance(event, Token):
                tokens.append(event.id)
            elif isinstance(event, Finished):
                reason = event.reason
        out.append((tokens, reason))
    return out


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


TRACED = {"prefill": 1, "decode": 2, "score": 3}  # by the warm-up: one per listed shape


def test_the_compiled_shapes_are_listed(engine):
    assert engine.shapes()[:2] == [
        f"decode: 1 slots x {LENGTH} positions x 1 steps",
        f"decode: {SLOTS} slots x {LENGTH} positions x 1 steps",
    ]
    assert engine.buckets.chunks == [16]
    assert engine.runner.traces == TRACED


def test_a_seeded_request_equals_generate_alone_and_among_30_others(model, engine):
    prompt = [5, 17, 33, 2, 90, 41, 8, 64, 12, 77, 3, 19, 50, 23, 44, 61, 70, 9, 31]  # 2 chunks
    settings = dict(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2)
    want = eqllm.generate(model, prompt, max_new_tokens=20, key=jax.random.key(42), **settings)
    alone = _drain(engine, [_submit(engine, prompt, max_tokens=20, seed=42, **settings)])
    assert alone[0] == (want.tolist(), "length")
    others = [
        _submit(engine, p, max_tokens=5 + i % 17, seed=i, temperature=1.0)
        for i, p in enumerate(_prompts(30))
    ]
    runs = others[:13] + [_submit(engine, prompt, max_tokens=20, seed=42, **settings)] + others[13:]
    together = _drain(engine, runs)
    assert together[13] == alone[0]
    assert all(reason == "length" for _, reason in together)
    # the others against generate too (row i with key i is generate with key i; a shorter
    # max_new_tokens gives a prefix of a longer one): every slot, every join and leave
    keys = jax.vmap(jax.random.key)(np.arange(30))
    refs = eqllm.generate_batch(model, _prompts(30), max_new_tokens=21, key=keys, temperature=1.0)
    got = [tokens for tokens, _ in together[:13] + together[14:]]
    assert got == [ref[: 5 + i % 17].tolist() for i, ref in enumerate(refs)]
    assert engine.runner.traces == TRACED  # nothing recompiled


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(engine):
    short = _submit(engine, [1, 2, 3], max_tokens=30, temperature=0)
    engine.step()  # the short prompt is prefilled and starts decoding
    produced = []
    long = _submit(engine, list(range(40)), max_tokens=3, temperature=0)
    for _ in range(3):  # 40 tokens: 3 chunks of 16, one per step, the short one decoding
        before = short[0].produced
        engine.step()
        produced.append(short[0].produced - before)
        assert long[0].cursor in (16, 32, 41)  # (41: its first token fed in the same round)
    assert produced == [1, 1, 1] and long[0].cursor == 41
    _drain(engine, [short, long])


def test_prompts_outnumbering_the_decoding_requests_get_a_chunk_each_per_round(engine):
    """A decode call reads every weight whatever its batch, so prompts that arrive while fewer
    requests decode are prefilled a chunk each per round and then decode together, not in
    turns behind a one-chunk budget."""
    first = _submit(engine, [1, 2, 3], max_tokens=30, temperature=0)
    engine.step()  # prefilled (its first token) and decoded (its second)
    later = [_submit(engine, [4 + i] * 20, max_tokens=3, temperature=0) for i in range(3)]
    engine.step()  # 3 prompts against 1 decoding: 16 tokens of each (one chunk: 16)
    assert [r.cursor for r, _ in later] == [16, 16, 16] and first[0].produced == 3
    engine.step()  # their last 4 tokens each, then one decode call for all four
    assert all(r.decoding for r, _ in [first, *later]) and first[0].produced == 4
    assert [r.produced for r, _ in later] == [2, 2, 2]
    assert [reason for _, reason in _drain(engine, [first, *later])] == ["length"] * 4


def test_generate_prefills_a_long_prompt_in_calls_of_bounded_memory(model, monkeypatch):
    """`eqllm.generate` takes a prompt in one prefill call only while that call's attention
    scores fit `sizing.SCORES_MEMORY`; in chunks, it gives the same tokens."""
    prompt = np.random.default_rng(1).integers(0, 97, 50).tolist()
    whole = eqllm.generate(model, prompt, max_new_tokens=6, key=jax.random.key(0), temperature=0)
    heads = model.config.attention.n_heads
    monkeypatch.setattr(sizing, "SCORES_MEMORY", 4 * heads * 16 * 80)  # 16 rows of 80 keys
    assert sizing.chunk_for(model.config, 64, 64) == 16  # (the prompt bucket, the context)
    widths, prefill = [], runner.Runner.prefill
    monkeypatch.setattr(
        runner.Runner, "prefill", lambda self, c, w, *a: widths.append(w) or prefill(self, c, w, *a)
    )
    chunked = eqllm.generate(model, prompt, max_new_tokens=6, key=jax.random.key(0), temperature=0)
    assert chunked.tolist() == whole.tolist() and widths == [16, 16, 16, 16]


def test_decode_runs_only_the_slots_and_positions_in_use(model):
    """One request decodes on the first slot alone; a reply that grows past 128 positions moves
    to the next view of the cache's blocks, windowed and global layers alike, and equals
    `eqllm.generate`; a second request in a higher slot runs every slot up to it."""
    cfg = TINY_CONFIGS["gemma2"].replace(max_seq_len=200)  # a window of 5 in every other layer
    model = eqllm.CausalLM(cfg, key=jax.random.key(7))
    engine = Engine(model, max_batch=8, max_len=200, prefill_chunk=64)
    sizes = engine.buckets
    assert (sizes.decode_slots, sizes.view_pages) == ([1, 4, 8], [8, 13])  # 16 positions each
    used = []
    decode = engine.runner.steps["decode"]

    def spy(state, table, *args, **sizes):
        used.append({**sizes, "length": table.shape[1] * engine.block_size})
        return decode(state, table, *args, **sizes)

    engine.runner.steps["decode"] = spy
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 97, 110)]
    settings = dict(temperature=0.9, top_p=0.95)
    want = eqllm.generate(model, prompt, max_new_tokens=40, key=jax.random.key(9), **settings)
    [(tokens, _)] = _drain(engine, [_submit(engine, prompt, max_tokens=40, seed=9, **settings)])
    assert tokens == want.tolist()
    assert {u["slots"] for u in used} == {1}
    assert [u["length"] for u in used] == [128] * 18 + [208] * 21  # position 128 from step 19
    used.clear()
    runs = [_submit(engine, [4, 5, 6], max_tokens=3, temperature=0) for _ in range(2)]
    _drain(engine, runs)
    assert {u["slots"] for u in used} == {4} and {u["length"] for u in used} == {128}


def test_prompts_prefilled_together_sample_as_generate_does(model):
    """Short prompts share prefill calls (up to 4 rows of 16 tokens, 2 of 32) and still give
    `eqllm.generate`'s tokens; padding rows write nothing. While no request decodes, a round
    prefills every prompt with a slot, whatever the budget (64 tokens)."""
    engine = Engine(model, max_batch=8, max_len=LENGTH, prefill_chunk=64)
    assert engine.buckets.prefill_rows == {16: [1, 4], 32: [1, 2], 64: [1]}
    calls = []
    prefill = engine.runner.steps["prefill"]
    engine.runner.steps["prefill"] = lambda state, slots, *a, **sizes: (
        calls.append(slots) or prefill(state, slots, *a, **sizes)
    )
    prompts = _prompts(12, seed=1)
    assert sum(len(p) for p in prompts[:8]) > 64
    runs = [
        _submit(engine, p, max_tokens=6, seed=i, temperature=1.0) for i, p in enumerate(prompts)
    ]
    engine.step()
    assert [r.produced for r, _ in runs] == [2] * 8 + [0] * 4  # first token, then one decoded
    got = [tokens for tokens, _ in _drain(engine, runs)]
    keys = jax.vmap(jax.random.key)(np.arange(12))
    refs = eqllm.generate_batch(model, prompts, max_new_tokens=6, key=keys, temperature=1.0)
    assert got == [ref.tolist() for ref in refs]
    assert max(int((slots < 8).sum()) for slots in calls) > 1  # several prompts in one call
    calls.clear()  # two short prompts alone: one call of 4 rows, 2 of them padding
    want = eqllm.generate(model, [5, 6], max_new_tokens=6, key=jax.random.key(3), temperature=1.0)
    pair = [_submit(engine, [5, 6], max_tokens=6, seed=3, temperature=1.0) for _ in range(2)]
    assert [tokens for tokens, _ in _drain(engine, pair)] == [want.tolist()] * 2
    assert [int((slots == 8).sum()) for slots in calls] == [2]


def test_requests_join_leave_and_reuse_slots(engine):
    runs = [_submit(engine, [7, 8, 9], max_tokens=2 + i, temperature=0) for i in range(6)]
    # 4 join; their 3-token prompts share one 16-token chunk, so all 4 are prefilled (1 token
    # each) and decoded (1 more) in this round; the first, at max_tokens=2, leaves
    engine.step()
    assert [r.slot for r, _ in runs[:SLOTS]] == [None, 1, 2, 3]  # the first left slot 0
    assert all(r.slot is None for r, _ in runs[SLOTS:])  # waiting: no slot was free
    assert [r.produced for r, _ in runs[:SLOTS]] == [2] * SLOTS and engine.busy() == 5
    engine.step()
    assert runs[4][0].slot == 0  # the freed slot, reused
    out = _drain(engine, runs)
    assert [len(t) for t, _ in out] == [2, 3, 4, 5, 6, 7]
    assert len({tuple(t[:2]) for t, _ in out}) == 1  # same greedy prefix in every slot


def test_stop_tokens_and_cancel(model, engine):
    prompt = list(range(4, 24))  # the bucket and length of the test above: compiled already
    free = eqllm.generate(model, prompt, max_new_tokens=20, key=jax.random.key(0), temperature=0)
    stop = int(free[3])
    first = free.tolist().index(stop)
    (out,) = _drain(
        engine, [_submit(engine, prompt, max_tokens=20, temperature=0, stop_tokens=(stop,))]
    )
    assert out == (free[: first + 1].tolist(), "stop")
    request, events = _submit(engine, prompt, max_tokens=30, temperature=0)
    engine.step()
    request.cancel()
    engine.step()
    assert engine.busy() == 0 and request.produced < 30


def test_prompt_logprobs_equal_the_full_forward(model, engine):
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    request, events = _submit(engine, prompt, max_tokens=0, prompt_logprobs=True)
    _drain(engine, [(request, queue.Queue())])
    scores = events.get()
    assert isinstance(scores, PromptScores) and scores.logprobs[0] is None
    logits = jax.nn.log_softmax(model(jnp.asarray(prompt)), axis=-1)
    want = [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    np.testing.assert_allclose(scores.logprobs[1:], want, atol=1e-5)
    assert isinstance(events.get(), Finished)


def test_bad_requests_and_a_full_queue(model):
    engine = Engine(model, max_batch=1, max_len=32, prefill_chunk=16, max_queue=2)
    with pytest.raises(ServeError, match="exceeds the context"):
        engine.check([1] * 30, Params(max_tokens=3))
    with pytest.raises(ServeError, match="vocab_size"):
        engine.check([1, 200], Params(max_tokens=3))
    with pytest.raises(eqllm.EqllmError, match="temperature"):
        engine.check([1], Params(max_tokens=3, temperature=-1))
    for _ in range(2):  # not started: they wait
        engine.submit([1], Params(max_tokens=1), lambda e: None)
    with pytest.raises(QueueFull, match="max_queue=2"):
        engine.submit([1], Params(max_tokens=1), lambda e: None)
    with pytest.raises(ServeError, match="max_len"):
        Engine(model, max_len=10_000)


@pytest.mark.slow  # its own engine compiled for a second model: 25 s
def test_latent_attention_and_a_dense_prefix_serve_as_generate_does():
    """DeepSeek's layout (a dense first layer, then experts; latent attention with its latent
    cache): the engine slices both stacks into layers, decodes as `eqllm.generate` does, and
    restacks them for the prompt scores."""
    cfg = eqllm.zoo.config("deepseek_v3-nano", vocab_size=97, d_model=32, max_seq_len=64)
    assert cfg.moe.dense_layers == 1 and cfg.attention.kind == "mla"
    model = eqllm.CausalLM(cfg, key=jax.random.key(5))
    engine = Engine(model, max_batch=2, max_len=48, prefill_chunk=16, max_queue=4)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    scored, events = _submit(engine, prompt, max_tokens=0, prompt_logprobs=True)
    [(tokens, reason)] = _drain(engine, [_submit(engine, prompt, max_tokens=6, temperature=0.0)])
    want = eqllm.generate(model, prompt, max_new_tokens=6, key=jax.random.key(0), temperature=0)
    assert tokens == np.asarray(want).tolist() and reason == "length"
    _drain(engine, [(scored, queue.Queue())])
    scores = events.get()
    logits = jax.nn.log_softmax(model(jnp.asarray(prompt)), axis=-1)
    wanted = [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    np.testing.assert_allclose(scores.logprobs[1:], wanted, atol=1e-5)


# The paged cache: blocks, prefix reuse, eviction, preemption -----------------------------------


def test_block_pool_counts_references_and_evicts_the_least_recently_released():
    pool = BlockPool(4, 2)
    hashes = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2 and hashes != block_hashes([1, 2, 3, 9], 2)
    assert hashes[0] == block_hashes([1, 2, 7, 7], 2)[0]  # chained: equal prefixes, equal hashes
    a, b = pool.allocate(), pool.allocate()
    for block, h in zip((a, b), hashes, strict=True):
        pool.register(block, h)
    assert pool.lookup(hashes, 5) == [a, b] and pool.refs[a] == 2  # held twice now
    pool.release([a, b])
    pool.release([a, b])  # nobody holds them: cached, b (a prompt's tail) first to go
    assert pool.available() == 4 and pool.used() == 0
    c, d = pool.allocate(), pool.allocate()  # the never-used blocks come first
    assert {c, d}.isdisjoint({a, b}) and pool.evicted == 0
    assert pool.allocate() == b and pool.evicted == 1  # then the least recently released
    assert pool.lookup(hashes, 5) == [a]  # b's hash is forgotten: the chain stops there
    assert pool.allocate() is None  # a is held again, the rest are in use
    assert pool.hit_rate() == (4 + 2) / (5 + 5)


def _spy_prefill(engine):
    calls = []
    prefill = engine.runner.steps["prefill"]

    def spy(state, slots, table, tokens, positions, *rest, **sizes):
        calls.append(np.asarray(positions))
        return prefill(state, slots, table, tokens, positions, *rest, **sizes)

    engine.runner.steps["prefill"] = spy
    return calls


@pytest.mark.parametrize(
    "family",
    ["llama", "mistral", *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama4", "gemma4"))],
)
def test_a_shared_prefix_is_computed_once_and_gives_generates_tokens(family):
    """A request that shares a 21-token start with an earlier one takes its 5 full blocks (of
    4 positions) from the cache and prefills only what follows; a third that continues the
    second's output (a chat's next turn) takes the blocks of that output too. Each draws what
    `eqllm.generate` draws; windowed layers (mistral: a window of 5) read their blocks alike,
    and so do chunked ones (llama4: chunks of 8, a ring of one chunk per layer); gemma4's global
    layers keep pools of their own head shape."""
    model = eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(3))
    engine = Engine(model, max_batch=2, max_len=LENGTH, prefill_chunk=16, block_size=4)
    calls = _spy_prefill(engine)
    system = [int(t) for t in np.random.default_rng(1).integers(0, 97, 21)]
    prompts = [system + [5, 6, 7], system + [8, 9]]
    for i, prompt in enumerate(prompts):  # one after the other: each finds the blocks before it
        [(tokens, _)] = _drain(engine, [_submit(engine, prompt, max_tokens=10, seed=i)])
    prompts.append(prompts[1] + tokens[:5] + [3])  # 29 tokens, 28 of them cached
    _drain(engine, [_submit(engine, prompts[2], max_tokens=10, seed=2)])
    starts = [int(p[p >= 0].min()) for p in calls if (p >= 0).any()]
    assert starts == [0, 16, 20, 28]
    assert engine.stats()["prefix_hit_tokens"] == 20 + 28
    assert engine.pool.used() == 0  # every request gave its blocks back
    for i, prompt in enumerate(prompts):  # again, and against generate
        [(tokens, _)] = _drain(engine, [_submit(engine, prompt, max_tokens=10, seed=i)])
        want = eqllm.generate(model, prompt, max_new_tokens=10, key=jax.random.key(i))
        assert tokens == want.tolist()


def test_a_pool_too_small_for_every_slot_preempts_and_recomputes(model):
    """Four sampled requests of 60 positions on a pool of 20 blocks (80 positions): the youngest
    give their blocks back and are computed again later, and every request still draws what
    `eqllm.generate` draws."""
    engine = Engine(
        model, max_batch=4, max_len=LENGTH, prefill_chunk=16, block_size=4, kv_blocks=20
    )
    prompts = _prompts(4, seed=5)
    runs = [
        _submit(engine, p, max_tokens=60 - len(p), seed=i, temperature=1.0)
        for i, p in enumerate(prompts)
    ]
    got = _drain(engine, runs)
    assert engine.scheduler.preempted > 0 and engine.pool.used() == 0
    for i, (prompt, (tokens, reason)) in enumerate(zip(prompts, got, strict=True)):
        want = eqllm.generate(
            model, prompt, max_new_tokens=60 - len(prompt), key=jax.random.key(i), temperature=1.0
        )
        assert (tokens, reason) == (want.tolist(), "length")


def test_cached_blocks_are_evicted_when_memory_runs_short(model):
    engine = Engine(model, max_batch=1, max_len=32, prefill_chunk=16, block_size=4, kv_blocks=10)
    first = list(range(1, 21))
    _drain(engine, [_submit(engine, first, max_tokens=2, temperature=0)])
    _drain(engine, [_submit(engine, first, max_tokens=2, temperature=0)])
    assert engine.stats()["prefix_hit_tokens"] == 16  # 4 blocks of the 20-token prompt
    for start in (30, 60):  # two other prompts take the pool's blocks
        _drain(engine, [_submit(engine, list(range(start, start + 20)), max_tokens=2)])
    assert engine.pool.evicted > 0
    _drain(engine, [_submit(engine, first, max_tokens=2, temperature=0)])
    assert engine.stats()["prefix_hit_tokens"] < 32  # some of its blocks were reused for others


@pytest.mark.parametrize("block_size", [4, 32])
def test_a_prompt_prefilled_in_chunks_across_blocks_gives_generates_tokens(model, block_size):
    """A 44-token prompt in chunks of 16: over blocks of 4 each chunk fills four blocks; over
    blocks of 32 the second chunk starts in the middle of a block, and the third continues the
    block the second began. Either way the request draws what `eqllm.generate` draws, its
    reply running on into the blocks after the prompt's."""
    engine = Engine(model, max_batch=2, max_len=LENGTH, prefill_chunk=16, block_size=block_size)
    calls = _spy_prefill(engine)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 97, 44)]
    [(tokens, _)] = _drain(engine, [_submit(engine, prompt, max_tokens=20, seed=4)])
    starts = [int(p[p >= 0].min()) for p in calls if (p >= 0).any()]
    assert starts == [0, 16, 32]
    want = eqllm.generate(model, prompt, max_new_tokens=20, key=jax.random.key(4))
    assert tokens == want.tolist()


def test_the_pool_is_sized_by_the_memory_budget_not_slots_times_context(monkeypatch):
    """With no budget given, an engine for a model of an 8,192-token context and 32 slots takes
    a share of the free memory (half of it on a CPU, at most 4 GiB), not 32 x 8,192 positions,
    and one request may still use the whole context; `describe` says what it reserved."""
    cfg = TINY_CONFIGS["llama"].replace(max_seq_len=8192)
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    per_position = 2 * 2 * cfg.attention.n_kv_heads * cfg.head_dim * 4  # k and v, 2 layers
    free = 4 * 8192 * per_position  # room for four full-length requests when halved
    monkeypatch.setattr(sizing, "free_memory", lambda device=None: (free, False))
    engine = Engine(model)
    assert (engine.max_batch, engine.max_len) == (32, 8192)
    assert engine.kv_blocks * engine.block_size == 2 * 8192  # half the free memory
    assert engine.kv_bytes == free // 2 < 32 * 8192 * per_position
    assert f"{engine.kv_bytes / 2**30:.2f} GiB reserved" in engine.describe()
    monkeypatch.setattr(sizing, "free_memory", lambda device=None: (free // 4, False))
    with pytest.raises(ServeError, match="--kv-cache-memory"):  # not one request would fit
        Engine(model)


def test_a_decode_step_holds_one_layers_views_at_a_time():
    """Slots decoding over 8,192 positions: the compiled step's temporaries do not grow with
    depth by every layer's views (gathered up front they did: 22.7 GiB for 32 slots of
    smollm2-135m beside a pool of 4 GiB), and the pool is written in place, never copied (XLA
    once copied it around the write for one slot)."""
    length = 8192

    def compiled(n_layers, slots):
        cfg = TINY_CONFIGS["llama"].replace(max_seq_len=length, n_layers=n_layers)
        model = eqllm.CausalLM(cfg, key=jax.random.key(0))
        params, static = eqx.partition(steps._sliced(model), eqx.is_array)
        state = steps.empty_state(model, slots, length // 16, 16)
        decode = steps._jitted(static, None)["decode"]
        out = decode.lower(
            params,
            state,
            np.zeros((slots, length // 16), np.int32),
            np.ones(slots, bool),
            np.ones(slots, np.int32),
            np.full((slots, 8), -1, np.int32),
            RowSettings(slots).stacked(slots),
            np.asarray(False),
            all_allowed(slots, cfg.vocab_size),
            slots=slots,
            steps=1,
            block_size=16,
        ).compile()
        return out, paged.bytes_per_token(model) // n_layers

    (shallow, _), (deep, per_layer) = compiled(2, 32), compiled(6, 32)
    view = 32 * length * per_layer  # one layer's keys and values for every slot
    temporaries = [s.memory_analysis().temp_size_in_bytes for s in (shallow, deep)]
    assert temporaries[1] - temporaries[0] < view / 2 and temporaries[1] < 4 * view
    for step in (deep, compiled(6, 1)[0]):
        assert not re.search(rf"= f32\[{length},[0-9,]+\]\S* copy\(", step.as_text())
