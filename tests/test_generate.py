"""Generation: the cache's layout, greedy == the argmax chain of full forwards, sampling
filters, batching, stop tokens, errors, and the `eqllm generate` command.

Every family's cached decoding against its full forward, and its greedy continuation against
transformers' `generate`, are tests/test_families.py's. The models here are tiny (d_model 32,
2 layers) with every parameter perturbed, so a bias, norm or plus-one norm mishandled on the
cached path shows up. Every test generates NEW tokens from prompts in one bucket, so the compiled
functions are shared across tests.
"""

import io
import json
import re

import equinox as eqx
import generate_cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
import eqllm.generation.steps
from eqllm import cli
from eqllm.commands import generate as generate_command
from eqllm.data import Tokenizer
from eqllm.generation import (
    GenerationError,
    filter_logits,
    sample_token,
    sampling,
    stream,
)
from tests.families import TINY_CONFIGS, params

NEW = 24
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]  # 9 tokens: longer than mistral's window of 5
LENGTH = 48  # the reference's tokens: PROMPT, then random ones


def perturbed(model, key):
    """`model` with N(0, 0.1) added to every floating parameter: no zero bias or unit norm."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


@pytest.fixture(scope="module")
def models():
    """Tiny perturbed models, built on first use."""

    class Lazy(dict):
        def __missing__(self, name):
            model = eqllm.CausalLM(TINY_CONFIGS[name], key=jax.random.key(0))
            self[name] = perturbed(model, jax.random.key(1))
            return self[name]

    return Lazy()


@eqx.filter_jit
def _reference(model, tokens, *, prefill: int, new: int):
    """Full-forward logits of `tokens`, and the greedy chain after tokens[:prefill] computed by
    repeated full forwards."""
    full = model(tokens)

    def chain(buffer, i):  # causal: the zeros after position i - 1 do not change its logits
        token = jnp.argmax(model(buffer)[i - 1]).astype(jnp.int32)
        return buffer.at[i].set(token), token

    buffer = jnp.zeros(prefill + new, jnp.int32).at[:prefill].set(tokens[:prefill])
    _, greedy = jax.lax.scan(chain, buffer, jnp.arange(prefill, prefill + new))
    return full, greedy


@pytest.fixture(scope="module")
def reference(models):
    results = {}

    def get(family):
        if family not in results:
            model = models[family]
            tail = jax.random.randint(
                jax.random.key(1), (LENGTH - len(PROMPT),), 0, model.config.vocab_size
            )
            tokens = jnp.concatenate([jnp.asarray(PROMPT), tail.astype(jnp.int32)])
            results[family] = _reference(model, tokens, prefill=len(PROMPT), new=NEW)
        return results[family]

    return get


@pytest.fixture(scope="module")
def greedy(models):
    """`eqllm.generate`'s greedy continuation of PROMPT, once per family."""
    results = {}

    def get(family):
        if family not in results:
            kw = dict(max_new_tokens=NEW, key=jax.random.key(0), temperature=0)
            results[family] = eqllm.generate(models[family], PROMPT, **kw)
        return results[family]

    return get


@pytest.mark.parametrize(
    "family", params(where=lambda t: t.config.attention.kind != "mla" and t.generates)
)
def test_each_layer_caches_its_window_or_the_whole_context(family):
    """A windowed layer's cache is a ring of just its window (a chunked layer's, of one chunk);
    a global layer's holds LENGTH; a hybrid's linear-attention layer and a Mamba-2 layer hold
    their recurrent state, the same at any length; a layer with Mamba-2 beside attention
    (Falcon-H1's) holds both, the pair (its keys and values, its state); a global layer of
    its own shape (Gemma 4's) holds its own heads; a feed-forward layer alone and a kv-shared layer
    keep nothing."""
    config = TINY_CONFIGS[family]
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(LENGTH), shapes)
    assert len(cache) == config.n_layers
    attention, lin = config.attention, config.linear
    kinds = config.layer_kinds()
    for layer_cache, local, kind in zip(cache, config.local_layers(), kinds, strict=True):
        if lin is not None and lin.parallel:
            layer_cache, state = layer_cache
            heads = (lin.n_value_heads, lin.value_head_dim, lin.key_head_dim)
            assert state.ssm.shape == heads and state.ssm.dtype == jnp.float32
        elif kind == "linear" and lin.kind == "mamba2":  # heads x head_dim x d_state
            heads = (lin.n_value_heads, lin.value_head_dim, lin.key_head_dim)
            assert layer_cache.ssm.shape == heads and layer_cache.ssm.dtype == jnp.float32
            continue
        if kind == "linear":
            heads = (lin.n_value_heads, lin.key_head_dim, lin.value_head_dim)
            assert layer_cache.recurrent.shape == heads
            continue
        if kind in ("ffn", "shared", "shared_global"):  # kv-shared: reads its source's cache
            assert layer_cache is None
            continue
        slots = (attention.sliding_window or attention.chunk_size) if local else LENGTH
        kv_heads, head_dim = attention.n_kv_heads, config.head_dim
        if kind == "global":
            kv_heads = attention.global_kv_heads or kv_heads
            head_dim = attention.global_head_dim or head_dim
        assert layer_cache.k.shape == (slots, kv_heads, head_dim)


def test_left_padding_is_invisible(models, reference):
    model = models["llama3"]
    padded = jnp.asarray([0, 0, 0, *PROMPT])
    positions = jnp.concatenate([jnp.full(3, -1), jnp.arange(len(PROMPT))])
    prefill = eqx.filter_jit(eqllm.CausalLM.prefill)
    logits, cache = prefill(model, padded, positions, model.init_cache(16))
    np.testing.assert_allclose(logits, reference("llama3")[0][len(PROMPT) - 1], atol=1e-4)
    assert sorted(np.asarray(cache[0].positions).tolist()) == [-1] * 7 + list(range(9))


@pytest.mark.parametrize("family", params({"gpt2"}, where=lambda t: t.generates))
def test_greedy_equals_argmax_chain(reference, greedy, family):
    assert greedy(family).tolist() == reference(family)[1].tolist()


BATCH = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]


def test_batched_equals_each_alone(models):
    model = models["mistral"]
    for kw in ({"temperature": 0}, {"top_k": 20}):
        keys = jax.random.split(jax.random.key(7), len(BATCH))
        batch = eqllm.generate_batch(model, BATCH, max_new_tokens=NEW, key=keys, **kw)
        for prompt, key, row in zip(BATCH, keys, batch, strict=True):
            alone = eqllm.generate(model, prompt, max_new_tokens=NEW, key=key, **kw)
            assert row.tolist() == alone.tolist()


def test_each_row_stops_at_its_own_stop_token(models):
    model = models["mistral"]
    kw = dict(max_new_tokens=NEW, key=jax.random.key(0), temperature=0)
    free = [row.tolist() for row in eqllm.generate_batch(model, BATCH, **kw)]
    stop = free[0][3]
    stopped = eqllm.generate_batch(model, BATCH, stop_tokens=[stop], **kw)
    for row, got in zip(free, stopped, strict=True):
        expected = row[: row.index(stop) + 1] if stop in row else row
        assert got.tolist() == expected
    assert len(stopped[0]) <= 4


def test_same_key_same_sample_and_keys_differ(models):
    model = models["mistral"]
    a = eqllm.generate(model, [1, 2], max_new_tokens=NEW, key=jax.random.key(1))
    b = eqllm.generate(model, [1, 2], max_new_tokens=NEW, key=jax.random.key(1))
    c = eqllm.generate(model, [1, 2], max_new_tokens=NEW, key=jax.random.key(2))
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert len(a) == NEW and a.dtype == np.int32
    one = eqllm.generate(model, [1, 2], max_new_tokens=1, key=jax.random.key(1))
    assert one.tolist() == a.tolist()[:1]


def test_settings_do_not_recompile(models):
    model = models["mistral"]
    traces = eqllm.generation.steps.TRACES
    eqllm.generate(model, [1, 2], max_new_tokens=NEW, key=jax.random.key(1))
    first = dict(traces)
    for kw in ({"temperature": 0.5, "top_k": 5}, {"top_p": 0.5, "min_p": 0.1}, {"temperature": 0}):
        eqllm.generate(model, [7, 8, 9], max_new_tokens=NEW, key=jax.random.key(3), **kw)
    assert traces == first  # the same engine shapes: nothing traced again


@pytest.mark.parametrize(
    "family",
    [
        f if f == "mistral" else pytest.param(f, marks=pytest.mark.slow)
        for f in generate_cases.MODELS
    ],
)
def test_seeded_outputs_equal_those_of_the_loop_before_the_engine(family):
    """Every setting of tests/generate_cases.py (greedy, sampled, top-k, top-p with min-p,
    repetition penalty with stop tokens), in a batch of four prompts and alone, gives the tokens
    the compiled loop that preceded the engine gave (pinned in tests/data)."""
    golden = json.loads(generate_cases.GOLDEN.read_text())[family]
    assert generate_cases.run(family) == golden


def test_stream_joins_to_generate(models):
    model = models["mistral"]
    kw = dict(max_new_tokens=NEW, key=jax.random.key(4), top_p=0.8, stop_tokens=())
    chunks = list(stream(model, [9, 8, 7], chunk=4, **kw))
    assert [len(c) for c in chunks] == [1] + [4] * ((NEW - 1) // 4) + [(NEW - 1) % 4]
    assert np.concatenate(chunks).tolist() == eqllm.generate(model, [9, 8, 7], **kw).tolist()


# Sampling filters on a distribution built by hand ----------------------------------------------

_draws = jax.jit(jax.vmap(sample_token, in_axes=(None, 0, None, None)))
LOGITS = jnp.log(jnp.asarray([0.05, 0.4, 0.02, 0.25, 0.15, 0.1, 0.03]))  # sorted: 1,3,4,5,0,6,2


@pytest.mark.parametrize(
    "kw, allowed",
    [
        ({"top_k": 3}, {1, 3, 4}),
        ({"top_p": 0.7}, {1, 3, 4}),  # 0.4 + 0.25 = 0.65 < 0.7: the third is needed
        ({"top_p": 0.6}, {1, 3}),
        ({"top_p": 0.01}, {1}),
        ({"min_p": 0.3}, {1, 3, 4}),  # p >= 0.12
        ({"top_k": 4, "top_p": 0.85}, {1, 3, 4}),  # renormalised in the top 4: 0.8/0.9 > 0.85
        ({"top_k": 5, "min_p": 0.2}, {1, 3, 4, 5}),
        ({}, set(range(7))),
    ],
)
def test_filters_never_sample_outside_allowed_set(kw, allowed):
    settings = sampling(**kw)
    finite = set(np.flatnonzero(np.isfinite(filter_logits(LOGITS, settings))).tolist())
    assert finite == allowed
    draws = _draws(LOGITS, jax.random.split(jax.random.key(0), 4000), jnp.zeros(7, bool), settings)
    seen = set(np.unique(np.asarray(draws)).tolist())
    assert seen == allowed  # inside the set, and every allowed token does occur


FILTER_CASES = [
    {"temperature": 0.7, "top_k": 50},
    {"top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.5},
    {"min_p": 0.05},
    {"temperature": 0.8, "top_k": 200, "top_p": 0.95, "min_p": 0.02},
]


def test_filters_match_transformers_warpers():
    """The allowed set equals transformers' temperature -> top-k -> top-p -> min-p warpers on
    a 5,000-token vocabulary; and one call over rows with their own settings equals one call
    per row."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    logits = 3 * jax.random.normal(jax.random.key(0), (len(FILTER_CASES), 5000))
    for row, kw in zip(logits, FILTER_CASES, strict=True):
        warpers = [transformers.TemperatureLogitsWarper(kw.get("temperature", 1.0))]
        if "top_k" in kw:
            warpers.append(transformers.TopKLogitsWarper(kw["top_k"]))
        if "top_p" in kw:
            warpers.append(transformers.TopPLogitsWarper(kw["top_p"]))
        if "min_p" in kw:
            warpers.append(transformers.MinPLogitsWarper(kw["min_p"]))
        scores = torch.from_numpy(np.array(row))[None]
        for warper in warpers:
            scores = warper(None, scores)
        expected = np.isfinite(scores[0].numpy())
        assert 1 < expected.sum() < 5000  # every filter case cuts something
        assert (np.isfinite(filter_logits(row, sampling(**kw))) == expected).all(), kw
    per_row = [
        filter_logits(row, sampling(**kw)) for row, kw in zip(logits, FILTER_CASES, strict=True)
    ]
    rows = jax.tree.map(lambda *a: jnp.stack(a), *[sampling(**kw) for kw in FILTER_CASES])
    np.testing.assert_array_equal(filter_logits(logits, rows), jnp.stack(per_row))


def test_draws_follow_the_distribution():
    draws = _draws(
        LOGITS, jax.random.split(jax.random.key(1), 20000), jnp.zeros(7, bool), sampling()
    )
    frequencies = np.bincount(np.asarray(draws), minlength=7) / 20000
    np.testing.assert_allclose(frequencies, np.exp(LOGITS), atol=0.01)  # 3 sigma at p = 0.4


def test_low_temperature_matches_greedy():
    keys = jax.random.split(jax.random.key(0), 4000)
    for temperature in (1e-3, 0.0):
        draws = _draws(LOGITS, keys, jnp.zeros(7, bool), sampling(temperature))
        assert set(np.asarray(draws).tolist()) == {1}


def test_repetition_penalty_is_ctrl_style():
    logits = jnp.asarray([3.0, 2.0, -1.0, -0.5])
    present = jnp.asarray([True, False, True, False])
    greedy = sampling(0.0, repetition_penalty=2.0)
    assert int(sample_token(logits, jax.random.key(0), present, greedy)) == 1  # 3/2 < 2
    assert int(sample_token(logits, jax.random.key(0), ~present, greedy)) == 0
    only_negatives = jnp.asarray([-1.0, -1.5, -3.0, -3.0])
    # -1 * 2 = -2 falls below -1.5
    assert int(sample_token(only_negatives, jax.random.key(0), present, greedy)) == 1


# Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kw, message",
    [
        ([], {}, "prompt 0 is empty"),
        (list(range(65)), {}, "longer than the context"),
        ([1, 2, 3], {"max_new_tokens": 62}, "exceeds the context max_seq_len=64"),
        ([1, 2, 3], {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ([1, 200], {}, "outside \\[0, vocab_size=97\\)"),
        ([1, 2], {"top_p": 0.0}, "top_p must lie in"),
        ([1, 2], {"top_p": 1.5}, "top_p must lie in"),
        ([1, 2], {"temperature": -1.0}, "temperature must be"),
        ([1, 2], {"temperature": float("nan")}, "temperature must be"),
        ([1, 2], {"top_k": 0}, "top_k must be a positive integer"),
        ([1, 2], {"min_p": 2.0}, "min_p must lie in"),
        ([1, 2], {"repetition_penalty": 0.0}, "repetition_penalty must be"),
        ([1, 2], {"stop_tokens": [500]}, "stop_tokens must be token ids"),
        ([1.0, 2.0], {}, "must hold integer token ids"),
        ([[1, 2]], {}, "must be a 1-D sequence"),
    ],
)
def test_bad_input_gives_clear_errors(models, prompt, kw, message):
    kw = {"max_new_tokens": 4, "key": jax.random.key(0), **kw}
    with pytest.raises(GenerationError, match=message):
        eqllm.generate(models["gpt2"], prompt, **kw)


def test_batch_errors(models):
    with pytest.raises(GenerationError, match="no prompts"):
        eqllm.generate_batch(models["gpt2"], [], max_new_tokens=2, key=jax.random.key(0))
    with pytest.raises(GenerationError, match="one per prompt"):
        eqllm.generate_batch(
            models["gpt2"], [[1], [2]], max_new_tokens=2, key=jax.random.split(jax.random.key(0), 3)
        )
    with pytest.raises(GenerationError, match="chunk must be a positive integer"):
        next(stream(models["gpt2"], [1], max_new_tokens=2, key=jax.random.key(0), chunk=0))


# The command line -----------------------------------------------------------------------------


@pytest.fixture
def tiny_zoo(monkeypatch, models):
    """`eqllm generate tiny` loads the tiny mistral (the zoo's smallest models are still big)."""
    real = generate_command.loading.load

    def load(spec, *, seed=0, dtype=None):
        return (models["mistral"], None) if spec == "tiny" else real(spec, seed=seed, dtype=dtype)

    monkeypatch.setattr(generate_command.loading, "load", load)


def _greedy(models, prompt, n):
    out = eqllm.generate(
        models["mistral"], prompt, max_new_tokens=NEW, key=jax.random.key(0), temperature=0
    )
    return " ".join(map(str, out[:n].tolist()))


def test_cli_prompt_streams_token_ids(models, tiny_zoo, capsys):
    argv = ["generate", "tiny", "--prompt", "1 2 3", "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--temperature", "0", "--chunk", "4"]) == 0
    assert capsys.readouterr().out.strip() == _greedy(models, [1, 2, 3], NEW)


def test_cli_timings_break_the_time_to_the_first_token_down(models, tiny_zoo, capsys):
    argv = ["generate", "tiny", "--prompt", "1 2 3", "--max-new-tokens", str(NEW), "--timings"]
    assert cli.main([*argv, "--temperature", "0", "--chunk", "4", "--compile-cache", "off"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == _greedy(models, [1, 2, 3], NEW)  # the same tokens, timed
    rows = re.findall(r"^  (\S.*?)\s+(\d+\.\d+) s", err.split("timings:\n")[1], re.MULTILINE)
    assert [name.split()[0] for name, _ in rows] == [
        "startup",
        "load",
        "tokenize",
        "prefill",
        "the",
    ]
    first = float(re.search(r"time to first token: (\d+\.\d+) s", err).group(1))
    seconds = [float(s) for _, s in rows]
    assert abs(first - sum(seconds[:4])) < 0.05  # startup and the phases up to the first token


@pytest.mark.slow
def test_cli_quantize_int8_generates_what_the_quantized_model_does(models, tiny_zoo, capsys):
    argv = ["generate", "tiny", "--prompt", "1 2 3", "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--temperature", "0", "--chunk", "4", "--quantize", "int8"]) == 0
    quantized = eqllm.quantize(models["mistral"], "int8")
    want = eqllm.generate(
        quantized, [1, 2, 3], max_new_tokens=NEW, key=jax.random.key(0), temperature=0
    )
    assert capsys.readouterr().out.strip() == " ".join(map(str, want.tolist()))


def test_cli_errors(tiny_zoo, capsys):
    assert cli.main(["generate", "tiny", "--prompt", "hello"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert cli.main(["generate", "tiny", "--prompt", "1", "--top-p", "2"]) == 2
    assert "top_p must lie in" in capsys.readouterr().err
    assert cli.main(["generate", "no-such-model", "--prompt", "1"]) == 2
    assert "unknown zoo model" in capsys.readouterr().err


def _feed(monkeypatch, lines):
    lines = iter(lines)

    def read(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)


def test_cli_interactive_session(models, tiny_zoo, monkeypatch, capsys):
    _feed(monkeypatch, ["/temp 0", "/max 5", "/topp 7", "1 2 3", "", "/bogus", "4 5", "/quit", "9"])
    assert cli.main(["generate", "tiny", "--interactive", "--chunk", "4"]) == 0
    out = capsys.readouterr().out
    assert "top_p must lie in" in out  # /topp 7 refused, session kept
    assert "unknown command /bogus" in out
    assert _greedy(models, [1, 2, 3], 5) + "\n" in out
    assert _greedy(models, [4, 5], 5) + "\n" in out
    assert "9" not in out.split("/bogus")[-1].split("tokens/s")[-1]  # nothing after /quit


def test_cli_interactive_ctrl_c_stops_only_the_generation(models, tiny_zoo, monkeypatch, capsys):
    real_stream = generate_command.stream
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        for i, ids in enumerate(real_stream(*args, **kwargs)):
            if len(calls) == 2 and i == 1:  # the first prompt (call 1 is the warm-up)
                raise KeyboardInterrupt
            yield ids

    monkeypatch.setattr(generate_command, "stream", interrupted)
    _feed(monkeypatch, ["/temp 0", "1 2 3", "4 5"])
    argv = ["generate", "tiny", "--interactive", "--chunk", "4", "--max-new-tokens", "6"]
    assert cli.main(argv) == 0  # end of input leaves normally
    out = capsys.readouterr().out
    assert "[stopped]" in out
    assert _greedy(models, [4, 5], 6) + "\n" in out


def test_loading_an_empty_folder_says_what_it_accepts(tmp_path):
    with pytest.raises(ValueError, match="no config.json in .* holds config.json"):
        eqllm.loading.load(str(tmp_path))


def test_printer_holds_back_partial_characters():
    out = io.StringIO()
    printer = generate_command._Printer(Tokenizer.bytes(), out)
    for b in "é!".encode():
        printer.add(np.asarray([b]))
    assert out.getvalue() == "é!"
