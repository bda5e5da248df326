"""SIGKILL during a step, an evaluation and a checkpoint write; each resume continues exactly."""

import numpy as np
import pytest

from .harness import (
    check_resumes,
    curves,
    kill_at,
    make_corpus,
    start,
    tiny_recipe,
    write_recipe,
)

STEPS = 30


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("kills")
    make_corpus(root)
    return root


def reference(root, name, **kw):
    """The uninterrupted run of a recipe (once per module and name)."""
    recipe = write_recipe(root / f"{name}.toml", tiny_recipe(root, root / "corpus", **kw))
    out = root / f"{name}-reference"
    if not (out / "summary.json").is_file():
        proc = start(recipe, out)
        output = proc.communicate(timeout=600)[0].decode()
        assert proc.returncode == 0, output[-3000:]
    return recipe, curves(out)


def check_same(killed, expected, steps=STEPS):
    assert {s for s, k in killed if k == "loss"} == set(range(1, steps + 1))
    assert killed == expected  # every train and validation loss, bit for bit


# Killed while a step is computed, while a checkpoint's files are written (its commit pending:
# the resume falls back to the one before), and during an evaluation.
DEFAULT_PLAN = ["step:8", "checkpoint:1", "eval:2"]


@pytest.mark.slow
def test_killed_three_times_resumes_to_the_same_losses(root, record_property):
    recipe, expected = reference(root, "bytes")
    out = root / "killed"
    stats = kill_at(recipe, out, DEFAULT_PLAN)
    assert stats["kills"] == 3 and stats["during_checkpoint_write"] >= 1
    check_resumes(stats, checkpoint_every=5)
    check_same(curves(out), expected)
    record_property("kills", stats["kills"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kw",
    [
        ("bytes", {}),
        ("accum", {"grad_accum": 2}),
        ("bpe", {"tokenizer": "bpe"}),
    ],
)
def test_random_kills_resume_to_the_same_losses(root, name, kw, record_property):
    recipe, expected = reference(root, f"{name}-60", steps=60, **kw)
    rng = np.random.default_rng(len(name))
    plan = ["step:3", "checkpoint:1", "eval:1", "checkpoint:2", "step:12"]
    plan += [float(x) for x in rng.uniform(0.0, 0.5, 5)]  # seconds after the first new row
    out = root / f"{name}-random"
    stats = kill_at(recipe, out, plan)
    print(
        f"{name}: {stats['kills']} kills {stats['phases']}, {stats['during_checkpoint_write']} "
        f"during a checkpoint write, {stats.get('finished_before_kill', 0)} finished first"
    )
    assert stats["kills"] >= 6 and stats["during_checkpoint_write"] >= 2
    check_resumes(stats, checkpoint_every=5)
    check_same(curves(out), expected, steps=60)
    record_property("kills", stats["kills"])
