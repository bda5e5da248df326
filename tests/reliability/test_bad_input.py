"""No input a user can give ends in a raw traceback or silent garbage: each gets a clear error.

Property-based (hypothesis) for recipes, `--set` overrides, model overrides and token arrays;
listed cases for data files, tokenizers, model folders and the command line. `TRIED` counts the
inputs tried; the last test checks the counts (docs/reliability.md reports them).
"""

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eqllm import CausalLM, hub, zoo
from eqllm.cli import main
from eqllm.config import ConfigError, ModelConfig
from eqllm.data import DataError, DataSource, prepare
from eqllm.eval.loss import check_token_range
from eqllm.model import check_tokens
from eqllm.recipe import Recipe, RecipeError, load_recipe
from eqllm.train import TrainStep, guards
from eqllm.train import loop as loop_mod

from .harness import TINY_MODEL, make_corpus, tiny_recipe

TRIED: Counter = Counter()
BASE = load_recipe("quickstart").to_dict()
LEAVES = sorted(guards._leaves(BASE))
TABLES = ["", "model", "data", "data.source", "optim", "train", "eval"]

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(-5, 5), max_size=2),
)


def _node(tree, path):
    for part in [p for p in path.split(".") if p]:
        tree = tree[part]
    return tree


@st.composite
def mutated_recipes(draw):
    """(dict, the path it changed): the quickstart recipe with 1-3 random mutations."""
    tree = json.loads(json.dumps(BASE))
    paths = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["set", "unknown", "delete", "not a table"]))
        if kind == "set":
            path = draw(st.sampled_from(LEAVES))
            parent, _, key = path.rpartition(".")
            try:
                _node(tree, parent)[key] = draw(values)
            except (KeyError, TypeError):
                continue
        elif kind == "unknown":
            table = draw(st.sampled_from(TABLES))
            key = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10))
            path = f"{table}.{key}".lstrip(".")
            try:
                node = _node(tree, table)
                if not isinstance(node, dict) or key in node:
                    continue
                node[key] = draw(values)
            except (KeyError, TypeError):
                continue
        else:
            path = draw(st.sampled_from(TABLES[1:] + LEAVES))
            parent, _, key = path.rpartition(".")
            try:
                node = _node(tree, parent)
                if kind == "delete":
                    del node[key]
                else:
                    node[key] = draw(st.one_of(st.integers(), st.text(max_size=5)))
            except (KeyError, TypeError):
                continue
        paths.append(path)
    return tree, paths


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_recipes())
def test_random_recipes_load_or_fail_with_a_recipe_error(case):
    values, paths = case
    TRIED["recipes"] += 1
    try:
        Recipe.from_dict(values)
    except RecipeError as e:
        message = str(e)
        TRIED["recipes rejected"] += 1
        # The message names the key path changed, or the table holding it.
        named = {".".join(p.split(".")[:i]) for p in paths for i in range(1, p.count(".") + 2)}
        assert any(n and n in message for n in named) or "the recipe" in message, (paths, message)
        assert "\n" not in message.strip() and len(message) < 1200, message


override_keys = st.one_of(
    st.sampled_from(LEAVES),
    st.text("abcdefghijklmnopqrstuvwxyz_.", min_size=0, max_size=20),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(override_keys, st.text(max_size=15)), min_size=1, max_size=3))
def test_random_set_overrides_fail_with_a_recipe_error(items):
    TRIED["--set overrides"] += 1
    overrides = [f"{k}={v}" for k, v in items]
    try:
        load_recipe("quickstart", overrides)
    except RecipeError as e:
        TRIED["--set overrides rejected"] += 1
        # It names the key of one of the overrides (or its table), or the malformed item.
        keys = {".".join(k.split(".")[:i]) for k, _ in items for i in range(1, k.count(".") + 2)}
        assert any(k and k in str(e) for k in keys) or "--set" in str(e), (items, str(e))


FIELDS = [f for f in ModelConfig.__dataclass_fields__]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(FIELDS), st.text("abcdefghij_", min_size=1, max_size=8)),
        values,
        min_size=1,
        max_size=3,
    )
)
def test_random_model_overrides_fail_with_a_config_error(overrides):
    TRIED["model overrides"] += 1
    try:
        cfg = zoo.config("llama-nano", **overrides)
    except ConfigError as e:
        TRIED["model overrides rejected"] += 1
        assert any(k in str(e) for k in overrides) or "ModelConfig" in str(e), str(e)
    else:
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.fixture(scope="module")
def model():
    return CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(["int32", "int16", "float32", "bool"]),
    low=st.integers(-200, 200),
)
def test_random_token_arrays_get_a_clear_error(model, shape, dtype, low):
    TRIED["token arrays"] += 1
    vocab = model.config.vocab_size
    tokens = (np.arange(int(np.prod(shape))).reshape(shape) + low).astype(dtype)
    ok_rank = len(shape) in (1, 2)
    ok_shape = ok_rank and 0 not in shape and shape[-1] <= model.config.max_seq_len
    ok_ids = tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < vocab)
    ok_dtype = np.issubdtype(tokens.dtype, np.integer)
    if ok_shape and ok_ids and ok_dtype:
        # Traced, not compiled: valid calls are tested elsewhere, this test is about errors.
        assert jax.eval_shape(model, jnp.asarray(tokens)).shape == (*shape, vocab)
        return
    TRIED["token arrays rejected"] += 1
    with pytest.raises(Exception) as info:
        model(jnp.asarray(tokens))
    if not ok_rank or not ok_dtype or not ok_shape:
        # The suite's jaxtyping hook may reject the call first (a TypeError too); users run
        # without it and get `check_tokens`' message, checked here directly.
        assert isinstance(info.value, (TypeError, ValueError))
        with pytest.raises((TypeError, ValueError)) as info:
            check_tokens(jnp.asarray(tokens), model.config)
    message = str(info.value)
    if not ok_rank:
        assert isinstance(info.value, TypeError) and "(batch, seq) integer array" in message
    elif not ok_dtype:
        assert isinstance(info.value, TypeError) and "integer dtype" in message
    elif not ok_shape:
        assert isinstance(info.value, ValueError)
        assert "tokens is empty" in message or "longer than the context" in message
    else:
        assert "token id out of range" in message and f"vocab_size={vocab}" in message


@pytest.mark.parametrize(
    "batch, needle",
    [
        (np.full((2, 9), 97, np.int32), "ids in [97, 97] but the model's vocab_size is 97"),
        (np.full((2, 9), -1, np.int32), "ids in [-1, -1]"),
        (np.zeros((9,), np.int32), "2-D integer array"),
        (np.zeros((2, 9), np.float32), "2-D integer array"),
    ],
)
def test_train_step_rejects_bad_batches_before_compiling(model, batch, needle):
    TRIED["train batches"] += 1
    step = TrainStep(__import__("optax").sgd(0.1), lambda s: 0.1)
    with pytest.raises((TypeError, ValueError)):
        step(model, None, jnp.asarray(batch))
    assert step.n_traces == 0
    # What users see (the suite's jaxtyping hook may reject a wrong rank or dtype first).
    with pytest.raises(DataError) as info:
        check_token_range(jnp.asarray(batch), model.config.vocab_size)
    assert needle in str(info.value)


def _write(folder, name, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


@pytest.mark.parametrize(
    "make, kind, needle",
    [
        (lambda p: _write(p / "d", "a.txt", b""), "files", "yielded no documents"),
        (lambda p: _write(p / "d", "bin.txt", bytes(range(256)) * 40), "files", "not UTF-8 text"),
        (lambda p: p / "missing", "files", "does not exist"),
        (lambda p: _write(p / "d", "a.jsonl", b'{"body": "x"}\n'), "jsonl", "text"),
        (lambda p: _write(p / "d", "a.jsonl", b"not json\n"), "jsonl", "JSON"),
    ],
)
def test_empty_binary_or_missing_data_gets_a_clear_error(tmp_path, make, kind, needle):
    TRIED["data files"] += 1
    path = make(tmp_path)
    with pytest.raises(DataError) as info:
        prepare(DataSource(kind=kind, path=str(path)), "bytes", cache_dir=tmp_path, progress=False)
    assert needle in str(info.value), str(info.value)


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path):
    TRIED["tokenizer/model vocab"] += 1
    corpus = make_corpus(tmp_path)
    recipe = tiny_recipe(tmp_path, corpus).replace(
        "model.overrides", {**TINY_MODEL, "vocab_size": 128}
    )
    with pytest.raises(RecipeError) as info:
        loop_mod.build_model(recipe, 257)
    assert "the tokenizer has 257 ids but the model's vocab_size is 128" in str(info.value)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p / "nowhere", "neither an existing folder nor a hub repo id"),
        (lambda p: _write(p / "m", "notes.txt", b"hi"), "no config.json"),
        (lambda p: _write(p / "m", "config.json", b'{"a": 1}'), "unsupported model_type"),
        (lambda p: _write(p / "m", "config.json", b"{oops"), "config.json"),
    ],
)
def test_missing_or_non_hf_model_folder_gets_a_clear_error(tmp_path, make, needle):
    TRIED["model folders"] += 1
    path = make(tmp_path)
    for load in (hub.from_pretrained, hub.load_any):
        with pytest.raises((ValueError, FileNotFoundError, OSError)) as info:
            load(str(path))
        assert needle in str(info.value), str(info.value)


CLI_CASES = [
    ("[model\nvariant = 1", [], "not valid TOML"),
    ('[model]\nvariant = "llama-nano"\n[train]\nsteps = -3\n', [], "train.steps=-3"),
    ('[model]\nvariant = "llama-nanoo"\n[train]\nsteps = 3\n', [], "did you mean llama-nano"),
    ('[model]\nvariant = "llama-nano"\n[train]\nsteps = 3\n', ["--set", "train"], "key=value"),
    ('[model]\nvariant = "llama-nano"\n[train]\nsteps = "3"\n', [], "must be int"),
    ("[train]\nsteps = 3\n", [], "missing the required key 'model'"),
    ('[model]\nvariant = "llama-nano"\n[train]\nsteps = 3\n', ["--resume"], "no checkpoint"),
]


@pytest.mark.parametrize("text, extra, needle", CLI_CASES)
def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, text, extra, needle):
    TRIED["command lines"] += 1
    recipe = tmp_path / "bad.toml"
    recipe.write_text(text)
    assert main(["run", str(recipe), "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eqllm: error: ") and needle in err, err
    assert "Traceback" not in err


def test_cli_missing_recipe_file_and_model_folder(tmp_path, capsys):
    TRIED["command lines"] += 2
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    corpus = make_corpus(tmp_path)
    recipe = tiny_recipe(tmp_path, corpus).replace("model.init_from", str(tmp_path / "nowhere"))
    (tmp_path / "r.toml").write_text(recipe.to_toml())
    args = ["run", str(tmp_path / "r.toml"), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("eqllm: error: ") and "neither an existing folder" in err


def test_counts(record_property):
    """Every group above ran (under pytest's default order) and most random inputs were bad."""
    print("bad inputs tried:", dict(TRIED))
    for key, value in TRIED.items():
        record_property(key, value)
    assert TRIED["recipes"] >= 100 and TRIED["recipes rejected"] >= 50
    assert TRIED["model overrides rejected"] >= 50 and TRIED["token arrays rejected"] >= 10
