"""Speculative decoding on the engine: greedy output equals non-speculative output token for
token (prompt lookup and draft models, requests joining and leaving, stop tokens, prefix hits,
sliding windows); sampled output follows the target's distribution (the acceptance rule on a
small vocabulary, and whole requests against the exact marginals of a tiny model); nothing is
traced again after the warm-up; bad settings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS
from scipy import stats

import eqllm
from eqllm.errors import EqllmError
from eqllm.generation import sampling
from eqllm.generation.speculate import accept, distribution
from eqllm.generation.speculator import lookup
from eqllm.serve import Engine, Finished, Params, Token

SLOTS, LENGTH, CHUNK = 4, 64, 16


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(3))


@pytest.fixture(scope="module")
def other():
    """A draft of another family and other weights, same vocabulary: it guesses badly."""
    return eqllm.CausalLM(TINY_CONFIGS["gemma2"], key=jax.random.key(5))


def _requests():
    """Prompts (some repeating themselves, for prompt lookup) and their settings."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, size=int(rng.integers(1, 30))).tolist() for _ in range(7)]
    prompts += [[5, 6, 7, 8, 9] * 5, [1, 2, 3] * 4 + [4], prompts[2] + prompts[2]]
    params = [Params(max_tokens=int(rng.integers(1, 24)), temperature=0.0) for _ in prompts]
    params[3] = Params(max_tokens=20, temperature=0.0, stop_tokens=(7, 40))
    params[8] = Params(max_tokens=20, temperature=0.0, repetition_penalty=1.3)
    return prompts, params


def _serve(model, prompts, params, **engine):
    """Every request through one engine of SLOTS slots (so they queue, join and leave);
    (tokens, finish reason) per request, and the engine."""
    e = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, **engine)
    events = [[] for _ in prompts]
    for p, q, out in zip(prompts, params, events, strict=True):
        e.submit(p, q, out.append)
    e.run(max_rounds=500)
    results = [
        (
            [x.id for x in out if isinstance(x, Token)],
            next(x.reason for x in out if isinstance(x, Finished)),
        )
        for out in events
    ]
    return results, e


@pytest.fixture(scope="module")
def plain(model):
    return _serve(model, *_requests())[0]


def test_greedy_prompt_lookup_equals_plain_decoding(model, plain):
    results, engine = _serve(model, *_requests(), speculate=3)
    assert results == plain
    stats_ = engine.stats()
    assert stats_["speculative_accepted"] > 0  # some guesses were kept...
    assert stats_["speculative_accepted"] < stats_["speculative_proposed"]  # ... some rejected


def _noisy(model, scale, seed=0):
    """The model with Gaussian noise added to its floating weights: a draft that mostly
    agrees with it."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noisy)


def test_greedy_with_a_draft_equals_plain_decoding(model, other, plain):
    for draft, low, high in [(_noisy(model, 0.005), 0.2, 0.99), (model, 1, 1)]:
        results, engine = _serve(model, *_requests(), speculate=3, draft=draft)
        assert results == plain
        assert low <= engine.stats()["speculative_acceptance"] <= high


@pytest.mark.slow
def test_prefix_hits_and_a_sliding_window_stay_exact(model, other):
    """A target with sliding windows (gemma2), prompts sharing their first blocks, so that
    later requests start from blocks an earlier one wrote while speculating."""
    shared = list(range(40, 76))
    prompts = [shared + [i, i + 1] for i in range(6)]
    params = [Params(max_tokens=20, temperature=0.0) for _ in prompts]
    plain, _ = _serve(other, prompts, params)
    for draft in (None, model):  # a draft of another family
        results, engine = _serve(other, prompts, params, speculate=3, draft=draft)
        assert results == plain
        assert engine.stats()["prefix_hit_tokens"] > 0


def test_generate_takes_speculate_and_draft(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    key = jax.random.key(0)
    expected = eqllm.generate(model, prompt, max_new_tokens=20, key=key, temperature=0)
    for draft in (None, _noisy(model, 0.005)):
        out = eqllm.generate(
            model, prompt, max_new_tokens=20, key=key, temperature=0, speculate=3, draft=draft
        )
        np.testing.assert_array_equal(out, expected)


def test_nothing_is_traced_after_the_warm_up(model):
    engine = Engine(model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, speculate=3)
    drafted = Engine(
        model, max_batch=SLOTS, max_len=LENGTH, prefill_chunk=CHUNK, speculate=3, draft=model
    )
    for e in (engine, drafted):
        e.warm()
        assert e.shapes()[0].startswith("speculate")
        traced = dict(e.speculator.traces), dict(e.runner.traces)
        prompts, params = _requests()
        for p, q in zip(prompts, params, strict=True):
            e.submit(p, q, lambda _: None)
        e.run(max_rounds=500)
        assert (e.speculator.traces, e.runner.traces) == traced
    assert "decode" not in drafted.runner.traces  # with a draft every round is speculative


def test_lookup_copies_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2).tolist() == [8, 5]  # 3-gram, latest
    assert lookup([7, 4, 5, 6, 4], 4).tolist() == [5, 6, 4]  # 1-gram; runs to the end
    assert lookup([1, 2, 3], 4).tolist() == []


# Sampling keeps the target's distribution --------------------------------------------------------

P = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.05, 0.3, 0.3, 0.3]]))
Q = jnp.asarray([[0.1, 0.6, 0.1, 0.1, 0.1]])  # a draft that likes token 1


@pytest.mark.parametrize("source", ["draft", "lookup"])
def test_the_acceptance_rule_keeps_the_target_distribution(source):
    """Speculative sampling on a 5-token vocabulary with one guess: the first token follows
    p0 whatever the guesses, and the token after a kept guess follows p1."""
    n = 40000
    p = jax.nn.softmax(P, axis=-1)
    keys = jax.random.split(jax.random.key(0), n)
    if source == "draft":  # guesses drawn from q
        guesses = jax.random.categorical(jax.random.key(1), jnp.log(Q[0]), shape=(n,))
        q = jnp.broadcast_to(Q, (n, 1, 5))
    else:  # prompt lookup: always the same guess, a point mass
        guesses = jnp.full((n,), 1)
        q = jax.nn.one_hot(guesses[:, None], 5)
    kept, after = jax.vmap(accept, in_axes=(None, 0, 0, None, 0))(
        p, q, guesses[:, None], jnp.asarray(1), keys
    )
    first = np.where(np.asarray(kept) == 1, np.asarray(guesses), np.asarray(after))
    frequencies = np.bincount(first, minlength=5) / n
    np.testing.assert_allclose(frequencies, p[0], atol=0.008)  # 3 sigma at p = 0.5
    second = np.asarray(after)[np.asarray(kept) == 1]
    np.testing.assert_allclose(np.bincount(second, minlength=5) / len(second), p[1], atol=0.02)


def test_distribution_is_what_the_sampler_draws():
    logits = jax.random.normal(jax.random.key(0), (3, 97)) * 3
    present = jnp.zeros((3, 97), bool).at[:, :10].set(True)
    rows = jax.tree.map(
        lambda *a: jnp.stack(a),
        sampling(0.0, repetition_penalty=1.5),
        sampling(0.7, top_k=20, repetition_penalty=1.5),
        sampling(1.0, top_p=0.8, min_p=0.05),
    )
    probs = distribution(logits, present, rows)
    draws = jax.vmap(lambda k: eqllm.generation.sample_tokens(logits, k, present, rows))(
        jax.random.split(jax.random.key(1), 60000).reshape(20000, 3)
    )
    for row in range(3):
        frequencies = np.bincount(np.asarray(draws[:, row]), minlength=97) / 20000
        np.testing.assert_allclose(frequencies, probs[row], atol=0.011)


def _exact_marginals(model, prompt, temperature):
    """The exact distributions of the first three sampled tokens (each summed over the
    tokens before it), by full forwards over every continuation."""
    vocab = model.config.vocab_size
    settings = sampling(temperature)

    def probs(tokens):  # (batch, seq) -> (batch, vocab): the next token's distribution
        logits = model(jnp.asarray(tokens))[:, -1]
        return jax.nn.softmax(eqllm.generation.filter_logits(logits, settings), axis=-1)

    base = np.asarray(prompt)[None]
    p1 = np.asarray(probs(base))[0]
    ones = np.arange(vocab)[:, None]
    p2 = np.asarray(probs(np.concatenate([base.repeat(vocab, 0), ones], 1)))  # [t1, t2]
    pairs = np.stack(np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij"), -1)
    pairs = pairs.reshape(-1, 2)
    p3 = np.asarray(probs(np.concatenate([base.repeat(len(pairs), 0), pairs], 1)))
    joint = p1[:, None] * p2  # [t1, t2]
    return p1, joint.sum(0), (joint.reshape(-1)[:, None] * p3).sum(0)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["draft", "lookup"])
def test_sampled_requests_follow_the_target_distribution(model, other, source):
    """3,000 seeded requests of 4 tokens, speculating 2 per round: the second and third tokens
    (drawn by one speculative round) follow the target's exact marginals (chi-square), and
    another model's marginal would not pass (the test can fail)."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    temperature, n = 0.03, 3000  # the tiny model's logits are within 0.5 of each other
    draft = _noisy(model, 0.005) if source == "draft" else None
    outs = eqllm.generate_batch(
        model,
        [prompt] * n,
        max_new_tokens=4,
        key=jax.random.key(7),
        temperature=temperature,
        speculate=2,
        draft=draft,
    )
    tokens = np.stack(outs)
    target = _exact_marginals(model, prompt, temperature)
    for position in (1, 2):
        assert _chisquare_p(tokens[:, position], target[position]) > 1e-3, position
    wrong = _exact_marginals(other, prompt, temperature)
    assert _chisquare_p(tokens[:, 1], wrong[1]) < 1e-6  # the test can tell them apart


def _chisquare_p(draws: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square test's p-value for `draws` against `probs` (tokens expected fewer than
    5 times pooled into one cell)."""
    observed = np.bincount(draws, minlength=len(probs)).astype(np.float64)
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * len(draws)
    big = expected >= 5
    f_obs, f_exp = observed[big], expected[big]
    if not big.all():
        f_obs = np.append(f_obs, observed[~big].sum())
        f_exp = np.append(f_exp, expected[~big].sum())
    return float(stats.chisquare(f_obs, f_exp).pvalue)


# Bad settings ------------------------------------------------------------------------------------


def test_bad_speculation_settings_are_refused(model):
    small = eqllm.CausalLM(TINY_CONFIGS["llama"].replace(vocab_size=96), key=jax.random.key(0))
    cases = [
        (dict(speculate=0), "speculate=0 must be an integer from 1"),
        (dict(speculate=-2), "speculate=-2"),
        (dict(speculate=True), "speculate=True"),
        (dict(draft=model), "a draft model needs speculate"),
        (dict(speculate=2, draft=small), "vocab_size=96 differs from the target's 97"),
        (dict(speculate=2, decode_steps=4), "keep decode_steps=1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(EqllmError, match=message):
            Engine(model, max_batch=2, max_len=LENGTH, prefill_chunk=CHUNK, **kwargs)
    with pytest.raises(EqllmError, match="speculate=0"):
        eqllm.generate(model, [1, 2], max_new_tokens=3, key=jax.random.key(0), speculate=0)


def test_serve_refuses_a_draft_without_speculate(capsys):
    from eqllm import cli

    assert cli.main(["serve", "llama-nano", "--draft", "llama-nano"]) == 2
    assert "--draft needs --speculate K" in capsys.readouterr().err


@pytest.mark.slow
def test_the_server_speculates_through_the_openai_client(tmp_path):
    """A served model drafting with itself and with prompt lookup: greedy completions (plain
    and streamed) equal `eqllm.generate`'s."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("transformers")
    from eqllm import loading
    from eqllm.serve.app import Service, create_app
    from tests.serve_helpers import ServerThread, tiny_folder

    model, tokenizer = loading.load(tiny_folder(tmp_path / "model"))
    prompt = "the cat sat on the mat and the cat sat on"
    ids = tokenizer.encode(prompt)
    want = eqllm.generate(model, ids, max_new_tokens=16, key=jax.random.key(0), temperature=0)
    want = want.tolist()
    if tokenizer.eot_id in want:
        want = want[: want.index(tokenizer.eot_id)]
    for draft in (None, model):
        engine = Engine(model, max_batch=2, max_len=128, prefill_chunk=32, speculate=3, draft=draft)
        with ServerThread(create_app(Service(engine, tokenizer, model_name="m"))) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            settings = dict(model="m", prompt=prompt, max_tokens=16, temperature=0)
            text = client.completions.create(**settings).choices[0].text
            streamed = "".join(
                c.choices[0].text for c in client.completions.create(**settings, stream=True)
            )
            assert text == streamed == tokenizer.decode(want)
