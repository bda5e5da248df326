"""Run folders (`eqllm.runs`): a run copied away from its data and caches generates, converts,
evaluates and serves; resuming it still needs its data; older folders without a format version
load; a newer format is refused."""

import json
import shutil

import jax
import numpy as np
import pytest
import tomli_w
import tomllib

from eqllm import hub, loading
from eqllm.cli import main
from eqllm.commands.serve import chat_format_of
from eqllm.runs import FORMAT_VERSION, NewerRunFormat, RunFolder
from tests.reliability.harness import make_corpus, tiny_recipe


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A 20-step run on a files source, moved to another folder; its corpus, token cache and
    compile cache deleted."""
    root = tmp_path_factory.mktemp("trained")
    corpus = make_corpus(root / "data")
    recipe = tiny_recipe(root, corpus, steps=20, eval_every=10, checkpoint_every=10)
    recipe_file = root / "mine.toml"
    recipe_file.write_text(recipe.to_toml())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EQLLM_CACHE", str(root / "cache"))
        args = ["run", str(recipe_file), "--out", str(root / "runs/mine"), "--no-progress"]
        assert main(args) == 0
    elsewhere = tmp_path_factory.mktemp("laptop")
    folder = shutil.move(root / "runs/mine", elsewhere / "copied")
    for gone in (corpus, root / "tokens", root / "jax", root / "cache"):
        shutil.rmtree(gone, ignore_errors=True)
    return folder, recipe_file, corpus


def test_a_moved_run_without_its_data_generates_converts_evaluates_and_serves(
    copied, tmp_path, capsys
):
    folder, _, corpus = copied
    assert not corpus.exists()
    summary = json.loads((folder / "summary.json").read_text())
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["convert", str(folder), str(tmp_path / "hf")]) == 0
    model, tokenizer = loading.load(folder)  # what `eqllm serve` loads, and its chat format
    assert tokenizer.kind == "bytes" and chat_format_of(str(folder), tokenizer) is not None
    exported = hub.from_pretrained(tmp_path / "hf")
    np.testing.assert_array_equal(exported.embed.weight, model.embed.weight)
    assert main(["eval", str(folder)]) == 0
    assert "validation: loss" in capsys.readouterr().out
    evaluated = json.loads((folder / "eval-20.json").read_text())
    # The run's held-out tokens are kept in the folder: the same numbers as the run's own.
    assert evaluated["val"] == summary["val"] and evaluated["unigram"] == summary["unigram"]


def test_resuming_a_run_without_its_data_names_the_missing_data(copied, capsys):
    folder, recipe_file, corpus = copied
    args = ["run", str(recipe_file), "--out", str(folder), "--resume", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"data.source.path='{corpus}' does not exist" in err and "point it at" in err


def _as_written_before_the_format_version(folder, legacy):
    """A copy of `folder` as eqllm wrote run folders before run.json: config.toml,
    model_config.json, the tokenizer and the checkpoints (the recipe without train.objective
    and [distill], preference.loss "dpo"), no held-out tokens."""
    shutil.copytree(folder, legacy)
    (legacy / "run.json").unlink()
    (legacy / "heldout.npz").unlink()
    values = tomllib.loads((legacy / "config.toml").read_text())
    del values["train"]["objective"], values["distill"]
    values["preference"]["loss"] = "dpo"
    (legacy / "config.toml").write_text(tomli_w.dumps(values))
    return legacy


def test_a_folder_without_a_format_version_loads_and_evaluates_with_its_data(
    copied, tmp_path, capsys
):
    folder, _, corpus = copied
    legacy = _as_written_before_the_format_version(folder, tmp_path / "legacy")
    assert RunFolder(legacy).format_version == 0 and RunFolder(folder).format_version == 1
    model, _ = loading.load(legacy)
    ours, _ = loading.load(folder)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ours), strict=True):
        np.testing.assert_array_equal(a, b)
    assert RunFolder(legacy).objective() == "lm" and RunFolder(legacy).adapters() is None
    capsys.readouterr()
    # Evaluating it reads the data: gone, that is said with the fix.
    assert main(["eval", str(legacy)]) == 2
    err = capsys.readouterr().err
    assert "keeps no held-out tokens" in err and f"'{corpus}' does not exist" in err
    try:
        make_corpus(corpus.parent)  # the same documents again
        assert main(["eval", str(legacy)]) == 0
    finally:
        shutil.rmtree(corpus)
    summary = json.loads((folder / "summary.json").read_text())
    assert json.loads((legacy / "eval-20.json").read_text())["val"] == summary["val"]


def test_a_newer_format_is_refused_with_the_upgrade(copied, tmp_path, capsys):
    folder, _, _ = copied
    newer = shutil.copytree(folder, tmp_path / "newer")
    info = json.loads((newer / "run.json").read_text())
    assert info["format"] == FORMAT_VERSION and info["objective"] == "lm"
    (newer / "run.json").write_text(json.dumps({**info, "format": FORMAT_VERSION + 1}))
    with pytest.raises(NewerRunFormat, match="upgrade eqllm"):
        loading.load(newer)
    capsys.readouterr()
    assert main(["generate", str(newer), "--prompt", "def "]) == 2
    assert f"format {FORMAT_VERSION + 1}" in capsys.readouterr().err
