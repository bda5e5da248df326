"""Damaged checkpoints, failed saves, changed recipes on resume and non-finite steps."""

import errno
import json
import shutil

import jax.numpy as jnp
import pytest

from eqllm.cli import main
from eqllm.runs import Checkpointer
from eqllm.train import TrainStep, guards
from eqllm.train import loop as loop_mod

from .harness import curves, make_corpus, tiny_recipe

STEPS = 12


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A reference run of 12 steps, and a run stopped at step 9 (checkpoints 6 and 9)."""
    root = tmp_path_factory.mktemp("faults")
    corpus = make_corpus(root)
    recipe = tiny_recipe(
        root, corpus, steps=STEPS, checkpoint_every=3, keep_checkpoints=2, eval_every=4
    )
    kw = {"progress": False, "final_eval": False, "echo": quiet}
    loop_mod.run(recipe, root / "reference", **kw)
    stopped = loop_mod.run(recipe, root / "stopped", stop_after=9, **kw)
    assert stopped.step == 9
    assert Checkpointer(root / "stopped" / "checkpoints").steps() == [6, 9]
    return root, recipe, curves(root / "reference")


def copy_run(env, tmp_path):
    root, _, _ = env
    out = tmp_path / "run"
    shutil.copytree(root / "stopped", out)
    return out


def files_of(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def delete_array_file(ckpt):
    biggest = max(files_of(ckpt / "state"), key=lambda p: p.stat().st_size)
    biggest.unlink()


def truncate_array_file(ckpt):
    biggest = max(files_of(ckpt / "state"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def garble_array_bytes(ckpt):
    biggest = max(files_of(ckpt / "state"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0x5A
    biggest.write_bytes(bytes(data))


def remove_state_item(ckpt):
    shutil.rmtree(ckpt / "state")


def garble_meta(ckpt):
    for path in files_of(ckpt / "meta"):
        path.write_bytes(b"\x00{not json" + path.read_bytes()[5:])


def empty_every_file(ckpt):
    for path in files_of(ckpt):
        path.write_bytes(b"")


# One kind of damage runs by default; the others in the slow set.
DAMAGE = [
    delete_array_file,
    *(
        pytest.param(damage, marks=pytest.mark.slow)
        for damage in (
            truncate_array_file,
            garble_array_bytes,
            remove_state_item,
            garble_meta,
            empty_every_file,
        )
    ),
]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_damaged_checkpoint_falls_back_loudly_and_is_kept(env, tmp_path, damage):
    _, recipe, expected = env
    out = copy_run(env, tmp_path)
    damage(out / "checkpoints" / "9")
    said = []
    loop_mod.run(recipe, out, resume=True, progress=False, final_eval=False, echo=said.append)
    warning = next(line for line in said if line.startswith("WARNING"))
    assert f"checkpoint {out / 'checkpoints' / '9'} is damaged" in warning
    assert "step 6" in warning and "nothing deleted" in warning
    # Kept aside, and the resumed run's saves (keep_checkpoints=2) did not collect it.
    assert (out / "checkpoints" / "9.damaged").is_dir()
    assert Checkpointer(out / "checkpoints").steps() == [9, 12]
    assert curves(out) == expected  # steps 7-12 redone exactly


def strip_checksums(ckpt):
    """The checkpoint as an older writer left it: metadata without the arrays' checksums."""
    for path in files_of(ckpt / "meta"):
        text = path.read_text()
        if '"fingerprints"' in text:
            meta = json.loads(text)
            meta.pop("fingerprints")
            path.write_text(json.dumps(meta))


@pytest.mark.slow
def test_checkpoint_without_checksums_is_refused_unless_forced(env, tmp_path):
    _, recipe, expected = env
    out = copy_run(env, tmp_path)
    for step in ("6", "9"):
        strip_checksums(out / "checkpoints" / step)
    kw = {"progress": False, "final_eval": False, "echo": quiet}
    with pytest.raises(guards.UnverifiedCheckpoint, match="no checksums.*--force"):
        loop_mod.run(recipe, out, resume=True, **kw)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6", "9"]  # none moved
    result = loop_mod.run(recipe, out, resume=True, force=True, **kw)
    assert result.step == STEPS and curves(out) == expected


@pytest.mark.parametrize(
    "failure",
    [MemoryError(), OSError(errno.EIO, "Input/output error"), TypeError("a bug")],
    ids=["memory", "io-error", "bug"],
)
def test_a_restore_failure_that_is_not_damage_moves_nothing(env, tmp_path, monkeypatch, failure):
    _, recipe, _ = env
    out = copy_run(env, tmp_path)

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(Checkpointer, "restore", failing)
    with pytest.raises(type(failure)):
        loop_mod.run(recipe, out, resume=True, progress=False, final_eval=False, echo=quiet)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6", "9"]


def tamper_checksum(ckpt):
    """Bytes that still decode but differ from what was written: one array's recorded checksum
    no longer matches. (Garbling the data files instead is caught either by the checksums or,
    where the bytes fall in a compressed chunk, by the decoder: orbax lays the arrays out in its
    data files in a different order on every save, so which one depends on the save's timing.)"""
    for path in files_of(ckpt / "meta"):
        text = path.read_text()
        if '"fingerprints"' in text:
            meta = json.loads(text)
            key = sorted(meta["fingerprints"])[0]
            meta["fingerprints"][key] ^= 1
            path.write_text(json.dumps(meta))


def test_no_intact_checkpoint_is_an_error_that_moves_nothing(env, tmp_path, capsys):
    root, recipe, _ = env
    out = copy_run(env, tmp_path)
    tamper_checksum(out / "checkpoints" / "9")
    remove_state_item(out / "checkpoints" / "6")
    toml = tmp_path / "tiny.toml"
    toml.write_text(recipe.to_toml())
    assert main(["run", str(toml), "--out", str(out), "--resume", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "restores intact" in err
    assert "step 9:" in err and "checksums" in err and "step 6:" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["6", "9"]


@pytest.mark.parametrize(
    "code, needle",
    [
        (errno.ENOSPC, "the disk is full"),
        pytest.param(errno.EROFS, "the folder is not writable", marks=pytest.mark.slow),
    ],
)
def test_failed_save_is_a_clear_error_and_the_previous_checkpoint_survives(
    env, tmp_path, monkeypatch, capsys, code, needle
):
    # Root ignores file permissions, so a full disk / read-only folder is simulated inside
    # orbax's save path: writing the commit file of checkpoint 6 fails with that errno.
    from orbax.checkpoint._src.path import async_path

    _, recipe, expected = env
    original = async_path.write_text

    async def failing_write_text(path, text, *args, **kwargs):
        if "/6.orbax-checkpoint-tmp" in str(path):
            raise OSError(code, "simulated", str(path))
        return await original(path, text, *args, **kwargs)

    monkeypatch.setattr(async_path, "write_text", failing_write_text)
    toml = tmp_path / "tiny.toml"
    toml.write_text(recipe.to_toml())
    out = tmp_path / "run"
    assert main(["run", str(toml), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"could not write checkpoint step 6 into {out / 'checkpoints'}" in err
    assert needle in err and "step 3, is intact" in err and "--resume" in err
    assert Checkpointer(out / "checkpoints").steps() == [3]
    monkeypatch.undo()
    loop_mod.run(recipe, out, resume=True, progress=False, final_eval=False, echo=quiet)
    assert curves(out) == expected


@pytest.mark.parametrize(
    "change, needle, allowed",
    [
        ("train.batch_size=4", "train.batch_size: 8 -> 4", False),
        ("model.overrides.d_model=64", "model.overrides.d_model: 32 -> 64", False),
        ("data.seq_len=16", "data.seq_len: 32 -> 16", False),
        ("optim.lr=0.001", "optim.lr: 0.01 -> 0.001", False),
        ("train.seed=1", "train.seed: 0 -> 1", False),
        ("train.steps=14", "train.steps: 12 -> 14", True),
        ("eval.batches=1", "eval.batches: 2 -> 1", True),
    ],
)
def test_changed_recipe_on_resume_lists_the_differences(
    env, tmp_path, capsys, change, needle, allowed
):
    _, recipe, _ = env
    out = copy_run(env, tmp_path)
    toml = tmp_path / "tiny.toml"
    toml.write_text(recipe.to_toml())
    args = ["run", str(toml), "--out", str(out), "--resume", "--no-progress", "--set", change]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and str(out / "config.toml") in err
    assert ("pass --force" in err) == allowed and ("even with --force" in err) == (not allowed)
    if not allowed:
        assert main([*args, "--force"]) == 2
        assert "even with --force" in capsys.readouterr().err


@pytest.mark.slow
def test_force_accepts_a_longer_run(env, tmp_path):
    _, recipe, expected = env
    out = copy_run(env, tmp_path)
    said = []
    longer = recipe.replace("train.steps", 14)
    with pytest.raises(guards.ResumeMismatch):
        loop_mod.run(longer, out, resume=True, progress=False, final_eval=False, echo=said.append)
    result = loop_mod.run(
        longer, out, resume=True, force=True, progress=False, final_eval=False, echo=said.append
    )
    assert result.step == 14 and "--resume --force: train.steps: 12 -> 14" in said
    assert (9, "loss") in curves(out) and curves(out)[(9, "loss")] == expected[(9, "loss")]


def _non_finite_at(monkeypatch, calls):
    """The loop's train step reports a non-finite loss (update not applied) at these calls."""
    original = TrainStep.__call__
    seen = {"n": 0}

    def patched(self, model, opt_state, batch):
        seen["n"] += 1
        if seen["n"] in calls:  # the compiled step's contract: inputs returned unchanged
            return model, opt_state, {"loss": jnp.float32(jnp.nan), "finite": jnp.bool_(False)}
        return original(self, model, opt_state, batch)

    monkeypatch.setattr(TrainStep, "__call__", patched)


@pytest.mark.slow
def test_skip_nonfinite_skips_up_to_k_steps(env, tmp_path, monkeypatch, capsys):
    root, recipe, _ = env
    _non_finite_at(monkeypatch, {4, 7})
    out = tmp_path / "skip"
    result = loop_mod.run(
        recipe.replace("train.skip_nonfinite", 2),
        out,
        progress=False,
        final_eval=False,
        echo=quiet,
    )
    assert result.step == STEPS
    rows = curves(out)
    assert [s for (s, k), v in rows.items() if k == "loss" and v != v] == [4, 7]
    assert "(1 of train.skip_nonfinite=2)" in capsys.readouterr().err


@pytest.mark.slow
def test_one_more_nonfinite_step_than_allowed_stops_the_run(env, tmp_path, monkeypatch, capsys):
    _, recipe, _ = env
    _non_finite_at(monkeypatch, {4, 7})
    toml = tmp_path / "tiny.toml"
    toml.write_text(recipe.replace("train.skip_nonfinite", 1).to_toml())
    out = tmp_path / "run"
    assert main(["run", str(toml), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss (nan) or gradient norm at step 7" in err
    assert "after skipping 1 (train.skip_nonfinite=1)" in err
    assert "the last good checkpoint is step 6" in err
    assert Checkpointer(out / "checkpoints").steps() == [3, 6]
