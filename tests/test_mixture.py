"""Weighted mixtures (`data.sources`): shares, determinism, resume, per-source validation, errors;
and data.document_mask in a whole run."""

import dataclasses
import json

import numpy as np
import pytest

from eqllm.data import DataError, DataSource, MixtureData, prepare, share_tolerance
from eqllm.data.mixture import prepare_mixture, row_sources
from eqllm.recipe import Recipe, RecipeError
from eqllm.train import loop as loop_mod
from tests.reliability.harness import make_corpus
from tests.reliability.harness import tiny_recipe as harness_recipe


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.05, 0.95)])
def test_realised_shares_stay_within_the_stated_tolerance(weights):
    w = np.array(weights)
    batch, steps = 16, 300
    which = np.concatenate([row_sources(w, seed=3, step=s, batch_size=batch) for s in range(steps)])
    for n in (batch, 10 * batch, steps * batch):  # every prefix of the run, short and long
        shares = np.bincount(which[:n], minlength=len(w)) / n
        assert np.all(np.abs(shares - w / w.sum()) <= share_tolerance(n)), (n, shares)
    assert share_tolerance(steps * batch) < 0.02  # the tolerance is tight on a real run


def write_source(folder, name, alphabet, docs=20):
    """A files source whose text uses only `alphabet`: each row's source shows in its bytes."""
    rng = np.random.default_rng(len(name))
    path = folder / name
    path.mkdir()
    for i in range(docs):
        (path / f"{i}.txt").write_text("".join(rng.choice(list(alphabet), 200)))
    return DataSource.files(str(path))


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    sources = [
        ("letters", write_source(root, "letters", "abc"), 0.7),
        ("digits", write_source(root, "digits", "123"), 0.3),
    ]
    return prepare_mixture(
        sources, "bytes", seq_len=16, cache_dir=root / "cache", val_fraction=0.1, progress=False
    )


def test_each_row_comes_from_its_source_and_batches_are_pure_functions_of_seed_and_step(mixture):
    assert isinstance(mixture, MixtureData)
    tok = mixture.tokenizer
    allowed = [set(tok.encode("abc")) | {tok.eot_id}, set(tok.encode("123")) | {tok.eot_id}]
    counts = np.zeros(2)
    for step in range(20):
        batch = mixture.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
        which = row_sources(mixture.weights, seed=5, step=step, batch_size=8)
        for row, source in zip(batch, which, strict=True):
            assert set(row.tolist()) <= allowed[source]
        counts += np.bincount(which, minlength=2)
        again = mixture.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
        np.testing.assert_array_equal(batch, again)  # the same (seed, step), the same batch
        # Two processes each take their own rows of the same global batch.
        parts = [
            mixture.batch_at(
                step=step, seed=5, batch_size=8, seq_len=16, process_index=i, process_count=2
            )
            for i in range(2)
        ]
        np.testing.assert_array_equal(np.concatenate(parts), batch)
    assert abs(counts[0] / counts.sum() - 0.7) <= share_tolerance(160)


class ReadLog(np.ndarray):
    """A 1-D token array that records how many windows each fancy-indexed read takes."""

    reads: list

    def __getitem__(self, index):
        if isinstance(index, np.ndarray) and index.ndim == 2:
            self.reads.append(index.shape[0])
        return np.asarray(self)[index]


def read_log(tokens) -> ReadLog:
    log = np.asarray(tokens).view(ReadLog)
    log.reads = []
    return log


def test_each_process_reads_only_its_own_rows(mixture):
    logs = [read_log(d.train) for d in mixture.sources]
    spied = MixtureData(
        [dataclasses.replace(d, train=log) for d, log in zip(mixture.sources, logs, strict=True)],
        mixture.labels,
        mixture.weights,
    )
    for step in range(5):
        part = spied.batch_at(
            step=step, seed=5, batch_size=8, seq_len=16, process_index=1, process_count=4
        )
        whole = mixture.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
        np.testing.assert_array_equal(part, whole[2:4])
        assert sum(sum(log.reads) for log in logs) == 2  # two windows read, not eight
        for log in logs:
            log.reads.clear()


def test_each_source_has_its_own_cache_and_a_second_prepare_reuses_it(mixture, tmp_path):
    paths = {str(d.path) for d in mixture.sources}
    assert len(paths) == 2
    again = prepare(
        DataSource.files(str(mixture.sources[0].meta["source"]["path"])),
        mixture.tokenizer,
        cache_dir=mixture.sources[0].path.parent,
        val_fraction=0.1,
        progress=False,
    )
    assert again.path == mixture.sources[0].path


def recipe_with_sources(root, corpus, sources, **data):
    values = harness_recipe(root, corpus, steps=6, eval_every=3, checkpoint_every=3).to_dict()
    values["data"] = {**values["data"], "sources": sources, **data}
    return Recipe.from_dict(values)


def test_bad_sources_get_errors_naming_the_source(tmp_path):
    corpus = make_corpus(tmp_path)
    good = {"kind": "files", "path": str(corpus), "label": "code", "weight": 0.7}
    for weight in (0, -0.5):
        bad = {"kind": "files", "path": str(corpus), "label": "web", "weight": weight}
        with pytest.raises(RecipeError, match=r"data\.sources\[1\] \('web'\)\.weight=.* > 0"):
            recipe_with_sources(tmp_path, corpus, [good, bad])
    with pytest.raises(RecipeError, match=r"data\.sources.*1.*kind"):
        recipe_with_sources(tmp_path, corpus, [good, {"kind": "ftp", "path": "x", "weight": 1}])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "nothing.txt").write_text("")
    spec = {"kind": "files", "path": str(empty), "label": "blank", "weight": 0.3}
    with pytest.raises(DataError, match=r"data\.sources\[1\] \('blank'\).*no documents"):
        prepare_mixture(
            [
                ("code", DataSource.files(str(corpus)), 0.7),
                ("blank", DataSource.files(str(empty)), 0.3),
            ],
            "bytes",
            seq_len=16,
            cache_dir=tmp_path / "cache",
            progress=False,
        )
    assert recipe_with_sources(tmp_path, corpus, [good, spec]).data.sources[1].label == "blank"


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_staged_mixture_run_logs_each_sources_validation_loss_and_resumes_exactly(tmp_path):
    root = tmp_path
    code = make_corpus(root / "a")
    prose = root / "prose"
    prose.mkdir()
    rng = np.random.default_rng(1)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "slept"]
    for i in range(20):
        (prose / f"{i}.txt").write_text(" ".join(rng.choice(words, 300)) + "\n")
    sources = [
        {"kind": "files", "path": str(code), "label": "code", "weight": 0.7},
        {"kind": "files", "path": str(prose), "label": "prose", "weight": 0.3},
    ]
    stage = {"step": 2, "weights": [0.2, 0.8]}  # the resume at step 3 is inside this stage
    recipe = recipe_with_sources(root, code, sources, document_mask=True, weight_schedule=[stage])
    quiet = dict(progress=False, echo=lambda *a: None)
    loop_mod.run(recipe, root / "full", final_eval=False, **quiet)
    loop_mod.run(recipe, root / "part", stop_after=3, **quiet)
    loop_mod.run(recipe, root / "part", resume=True, final_eval=False, **quiet)
    full, part = metrics(root / "full"), metrics(root / "part")
    losses = lambda rows: {r["step"]: r["loss"] for r in rows if "loss" in r}  # noqa: E731
    assert losses(full) == losses(part)  # exact: the batch of step s is a function of (seed, s)
    evals = [r for r in full if "val/loss" in r]
    assert evals and all("val/code/loss" in r and "val/prose/loss" in r for r in evals)


def test_a_weight_schedule_changes_the_shares_from_its_step_on(mixture):
    staged = MixtureData(
        mixture.sources, mixture.labels, mixture.weights, stages=((10, [0.2, 0.8]),)
    )
    tok = mixture.tokenizer
    letters = set(tok.encode("abc")) | {tok.eot_id}
    from_letters = []
    for step in range(40):
        batch = staged.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
        np.testing.assert_array_equal(  # a pure function of (seed, step), as without stages
            batch, staged.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
        )
        if step < 10:  # before the stage: exactly the unstaged mixture's rows
            np.testing.assert_array_equal(
                batch, mixture.batch_at(step=step, seed=5, batch_size=8, seq_len=16)
            )
        from_letters += [set(row.tolist()) <= letters for row in batch]
    first, second = np.array(from_letters[:80]), np.array(from_letters[80:])
    assert abs(first.mean() - 0.7) <= share_tolerance(80)
    assert abs(second.mean() - 0.2) <= share_tolerance(240)
    assert staged.meta["weight_schedule"] == [{"step": 10, "weights": [0.2, 0.8]}]


def test_bad_weight_schedules_get_errors_naming_the_stage(mixture, tmp_path):
    for stages, match in (
        (
            ((5, [1.0, 1.0]), (5, [1.0, 0.0])),
            r"weight_schedule\[1\]: step=5 must be an int above 5",
        ),
        (((5, [1.0]),), r"weight_schedule\[0\]: weights=\[1.0\] must be 2 numbers"),
        (((5, [0.0, 0.0]),), r"weight_schedule\[0\]: .* not all 0"),
    ):
        with pytest.raises(DataError, match=match):
            MixtureData(mixture.sources, mixture.labels, mixture.weights, stages=stages)
    corpus = make_corpus(tmp_path)
    two = [
        {"kind": "files", "path": str(corpus), "label": "a", "weight": 0.7},
        {"kind": "files", "path": str(corpus), "label": "b", "weight": 0.3},
    ]
    with pytest.raises(RecipeError, match=r"data\.weight_schedule\[0\]\.weights=\[1\.0\] must"):
        recipe_with_sources(tmp_path, corpus, two, weight_schedule=[{"step": 3, "weights": [1.0]}])
    stages = [{"step": 3, "weights": [1, 0]}, {"step": 2, "weights": [0, 1]}]
    with pytest.raises(RecipeError, match=r"data\.weight_schedule\[1\]\.step=2 must be above 3"):
        recipe_with_sources(tmp_path, corpus, two, weight_schedule=stages)
    recipe = recipe_with_sources(tmp_path, corpus, two, weight_schedule=stages[:1])
    assert recipe.data.weight_schedule[0].weights == (1.0, 0.0)
