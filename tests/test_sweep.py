"""`eqllm sweep`: points as run folders, divergence, shards, results; resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eqllm import zoo
from eqllm.scaling import read_results
from eqllm.sweep import SweepError, load_sweep, parse_shard, run_sweep, shard_points
from tests.reliability.harness import CHILD, REPO, make_corpus, tiny_recipe


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    corpus = make_corpus(root)
    recipe = tiny_recipe(
        root, corpus, steps=6, eval_every=3, checkpoint_every=2, log_every=1, keep_checkpoints=2
    )
    path = root / "tiny.toml"
    text = recipe.to_toml().replace("sample_tokens = 4", "sample_tokens = 0")
    path.write_text(text)
    old = os.environ.get("EQLLM_CACHE")
    os.environ["EQLLM_CACHE"] = str(root / "cache")
    yield root
    if old is None:
        os.environ.pop("EQLLM_CACHE")
    else:
        os.environ["EQLLM_CACHE"] = old


def write_sweep(root, name, body):
    path = root / f"{name}.toml"
    path.write_text('recipe = "tiny.toml"\n' + body)
    return path


def test_shards_partition_the_points_exactly(env):
    path = write_sweep(
        env,
        "grid",
        '[grid]\n"optim.lr" = [0.01, 0.02, 0.04]\n"model.overrides.mlp.d_ff" = [32, 64, 96, 128]\n'
        '[[points]]\n"optim.lr" = 0.005\n[[points]]\noptim.lr = 0.0025\n',
    )
    sweep = load_sweep(path)
    assert len(sweep.points) == 14
    # The grid's first key varies slowest; dotted TOML keys mean the same recipe path.
    assert sweep.points[1].settings == {"optim.lr": 0.01, "model.overrides.mlp.d_ff": 64}
    assert sweep.points[13].settings == {"optim.lr": 0.0025}
    everything = [p.index for p in sweep.points]
    for n in range(1, 6):
        shards = [[p.index for p in shard_points(sweep.points, i, n)] for i in range(n)]
        assert sorted(sum(shards, [])) == everything  # every point in exactly one shard
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(SweepError, match="--shard"):
            parse_shard(bad)


def test_bad_sweep_files_name_the_problem(env):
    with pytest.raises(SweepError, match="unknown key 'gird'"):
        load_sweep(write_sweep(env, "bad1", '[gird]\n"optim.lr" = [1]\n'))
    with pytest.raises(SweepError, match="no points"):
        load_sweep(write_sweep(env, "bad2", '[set]\n"train.steps" = 3\n'))
    with pytest.raises(SweepError, match="point 001"):  # checked before any point runs
        load_sweep(write_sweep(env, "bad3", '[grid]\n"optim.lr" = [0.01, -1.0]\n'))


@pytest.mark.slow
def test_divergence_is_detected_and_results_are_exact(env):
    path = write_sweep(env, "lrs", '[grid]\n"optim.lr" = [0.003, 30.0]\n')
    sweep = load_sweep(path)
    out = env / "runs" / "lrs"
    assert run_sweep(sweep, out, echo=lambda *a: None) is None
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["000", "001"]
    good, bad = rows
    assert not good["diverged"] and bad["diverged"] and bad["loss"] is None
    assert bad["steps"] < 6  # stopped early
    cfg = zoo.config("llama-nano").replace(
        d_model=32,
        n_layers=2,
        max_seq_len=64,
        vocab_size=320,
        **{"attention.n_heads": 4, "attention.n_kv_heads": 2, "mlp.d_ff": 64},
    )
    assert good["params"] == zoo.param_count(cfg)
    assert good["non_embedding_params"] == good["params"] - 320 * 32  # untied: the table only
    assert good["tokens"] == 6 * 8 * 32
    assert good["flops"] == pytest.approx(cfg.flops_per_token(32) * good["tokens"])
    assert 0 < good["loss"] < 6 and good["best_loss"] <= good["loss"] + 1e-9
    assert good["lr"] == 0.003 and good["d_model"] == 32
    for name in ("results.md", "lr_transfer.png", "loss_vs_compute.png"):
        assert (out / name).stat().st_size > 0
    assert "yes" in (out / "results.md").read_text()  # the diverged row says so
    assert len(read_results(out / "results.jsonl")) == 1  # fits leave diverged points out
    # Run again: nothing reruns (no point's metrics change).
    before = (out / "000" / "metrics.jsonl").read_bytes()
    said = []
    run_sweep(sweep, out, echo=said.append)
    assert (out / "000" / "metrics.jsonl").read_bytes() == before
    assert not any(line.startswith("point ") for line in said)


@pytest.mark.slow
def test_a_killed_sweep_resumes_where_it_stopped(env):
    path = write_sweep(env, "kill", '[grid]\n"optim.lr" = [0.01, 0.005, 0.0025]\n')
    out = env / "runs" / "kill"
    marker = env / "kill.marker"
    cmd = [sys.executable, str(CHILD), "sweep", str(path), "--out", str(out), "--no-progress"]
    run_env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Paused after the 11th step of the process: point 001's 5th, after its step-2 and step-4
    # checkpoints (orbax commits them in the background: at least one is done by then).
    child = subprocess.Popen(
        cmd,
        env={**run_env, "EQLLM_PAUSE": "step:11", "EQLLM_PAUSE_MARKER": str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 400
    while not marker.exists():
        assert child.poll() is None, child.stdout.read().decode()
        assert time.time() < deadline
        time.sleep(0.5)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (out / "000" / "result.json").is_file()
    assert not (out / "001" / "result.json").exists()
    saved = [p.name for p in (out / "001" / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved, "point 001 had no checkpoint when it was killed"
    first = (out / "000" / "metrics.jsonl").read_bytes()

    done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 finished before" in done.stdout
    assert "point 000" not in done.stdout  # not rerun
    assert "point 001 {'optim.lr': 0.005} (resuming)" in done.stdout
    assert (out / "000" / "metrics.jsonl").read_bytes() == first
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["000", "001", "002"]
    # The resumed point logged every step once: those before its checkpoint, then the rest.
    steps = [
        json.loads(line)["step"]
        for line in (out / "001" / "metrics.jsonl").read_text().splitlines()
        if "grad_norm" in json.loads(line)
    ]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_jobs_split_the_visible_gpus(monkeypatch):
    from eqllm.sweep.runner import device_groups

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert device_groups(2) == ["0,1", "2,3"]
    assert device_groups(3) == ["0", "1", "2"]  # the fourth is left idle, not shared
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert device_groups(2) is None  # fewer GPUs than jobs: the workers share what there is


@pytest.mark.slow
def test_jobs_run_points_in_worker_processes_at_once(env, monkeypatch):
    import eqllm.sweep.runner as runner

    live, most = [], []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live.append(self)
            most.append(sum(p.poll() is None for p in live))

    monkeypatch.setattr(runner.subprocess, "Popen", Recorded)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    lrs = write_sweep(env, "jobs", '[grid]\n"optim.lr" = [0.003, 0.006, 0.012]\n')
    out = env / "runs" / "jobs"
    assert run_sweep(load_sweep(lrs), out, jobs=2, echo=lambda *a: None) is None
    assert len(live) == 3 and max(most) == 2  # two workers at once, a third after one ended
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["000", "001", "002"]
    assert not any(r["diverged"] for r in rows)
    # A worker's point is the point run in this process.
    one = write_sweep(env, "one", '[grid]\n"optim.lr" = [0.006]\n')
    assert run_sweep(load_sweep(one), env / "runs" / "one", echo=lambda *a: None) is None
    alone = json.loads((env / "runs" / "one" / "results.jsonl").read_text().splitlines()[0])
    assert alone["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "path", sorted((REPO / "recipes" / "sweeps").glob("*.toml")), ids=lambda p: p.name
)
def test_shipped_sweep_files_load_with_every_point_checked(path):
    """The sweep files the studies of docs/scaling-laws.md run: each point's recipe is valid."""
    sweep = load_sweep(path)
    assert sweep.points and all(p.settings for p in sweep.points)
    widths = {sweep.point_recipe(p).model.overrides["d_model"] for p in sweep.points}
    assert len(widths) > 1  # every shipped study spans several widths
