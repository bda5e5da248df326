"""A multi-process run under faults: preemption, a lost process, another process count on
restart, a damaged checkpoint on resume, one console.

Processes of simulated CPU devices joined by `--coordinator` (jax.distributed over gloo), as in
tests/test_multiprocess.py. Every run is bounded in time and its processes killed at the end
whatever happened. Slow: `pytest -m slow tests/reliability/test_processes.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eqllm.recipe import Recipe

from .harness import REPO, make_corpus, tiny_recipe

pytestmark = pytest.mark.slow

STEPS = 16
BOUND = 600  # seconds any one run may take before it counts as hung (generous: shared CI CPUs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Run:
    """`eqllm run` as `processes` processes of `devices` simulated devices each."""

    def __init__(self, recipe: Path, out: Path, processes: int, devices: int, *extra: str):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "EQLLM_CACHE": str(recipe.parent / "cache"),
        }
        args = [sys.executable, "-m", "eqllm.cli", "run", str(recipe), "--out", str(out)]
        if processes > 1:
            args += ["--coordinator", f"localhost:{free_port()}"]
            args += ["--num-processes", str(processes)]
        self.procs = [
            subprocess.Popen(
                [*args, *(["--process-id", str(i)] if processes > 1 else []), *extra],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(processes)
        ]
        self.out = out

    def wait(self, timeout: float = BOUND) -> list[tuple[int, str, str]]:
        """(status, stdout, stderr) of every process; kills them all past `timeout`."""
        deadline = time.monotonic() + timeout
        results = []
        try:
            for p in self.procs:
                left = max(1.0, deadline - time.monotonic())
                out, err = p.communicate(timeout=left)
                results.append((p.returncode, out, err))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"a process of the run in {self.out} ran past {timeout} s"
            ) from None
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()

    def wait_for_rows(self, n: int, timeout: float = BOUND) -> None:
        """Wait until metrics.jsonl holds `n` training rows."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                raise AssertionError("a process ended before the fault was injected")
            if len(losses(self.out)) >= n:
                return
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"no {n} training rows within {timeout} s")


def finished(run: Run, timeout: float = BOUND) -> list[tuple[int, str, str]]:
    results = run.wait(timeout)
    for status, out, err in results:
        assert status == 0, (out + err)[-4000:]
    return results


def losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def checkpoints(out: Path) -> list[str]:
    """The committed checkpoints' steps, in order."""
    steps = (int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    return [str(s) for s in sorted(steps)]


def assert_same_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(got) == sorted(expected)
    np.testing.assert_allclose([got[s] for s in expected], list(expected.values()), rtol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run on one process of 8 devices, and the same recipe on 2 processes x 4
    devices stopped by SIGTERM to process 1 after a few steps (process 1 with progress bars)."""
    root = tmp_path_factory.mktemp("processes")
    values = tiny_recipe(
        root, make_corpus(root), steps=STEPS, eval_every=0, checkpoint_every=3, keep_checkpoints=5
    ).to_dict()
    values["mesh"] = {"data": 4, "fsdp": 2}
    recipe = root / "tiny.toml"
    recipe.write_text(Recipe.from_dict(values).to_toml())
    finished(Run(recipe, root / "reference", 1, 8, "--no-progress"))

    stopped = Run(recipe, root / "stopped", 2, 4)
    stopped.wait_for_rows(4)
    stopped.procs[1].send_signal(signal.SIGTERM)
    results = stopped.wait()
    return root, recipe, losses(root / "reference"), results


def test_a_signal_to_one_process_stops_all_after_the_same_step(runs):
    root, _, expected, results = runs
    said = [
        re.search(r"SIGTERM \(received by process 1\): saved checkpoint at step (\d+)", out)
        for _, out, _ in results
    ]
    assert [status for status, _, _ in results] == [143, 143], results
    assert said[0] is not None, results[0]
    step = int(said[0].group(1))
    assert 4 <= step < STEPS
    # One checkpoint, at the step both stopped after; the log of process 1 says the same step.
    assert checkpoints(root / "stopped")[-1] == str(step)
    log1 = (root / "stopped" / "logs" / "process-1.log").read_text()
    assert f"saved checkpoint at step {step} " in log1
    assert sorted(losses(root / "stopped")) == list(range(1, step + 1))


def test_process_one_prints_only_its_warnings_and_errors(runs):
    root, _, _, results = runs
    _, out1, err1 = results[1]
    _, out0, err0 = results[0]
    assert "run folder:" in out0 and "saved checkpoint" in out0
    # Process 1 ran with progress bars asked for: none shown, and no run lines.
    console1 = out1 + err1
    for line in console1.splitlines():
        if line.startswith("[process 1] "):
            continue
        assert not re.search(r"train:|step \d+|run folder|saved checkpoint", line), line
    assert "it/s" not in console1 and "step/s" not in console1
    log0 = (root / "stopped" / "logs" / "process-0.log").read_text()
    assert "run folder:" in log0


def resume(runs, tmp_path, processes, devices, *extra, damage=None):
    root, recipe, expected, _ = runs
    out = tmp_path / "run"
    shutil.copytree(root / "stopped", out)
    if damage:
        damage(out / "checkpoints")
    results = finished(Run(recipe, out, processes, devices, "--no-progress", "--resume", *extra))
    return out, expected, results


def test_the_preempted_run_resumes_exactly(runs, tmp_path):
    out, expected, _ = resume(runs, tmp_path, 2, 4)
    assert_same_losses(losses(out), expected)


@pytest.mark.parametrize(
    "processes, devices, extra",
    [
        (1, 8, ()),
        (4, 2, ()),
        (1, 2, ("--set", "mesh.data=2", "--set", "mesh.fsdp=1", "--force")),
    ],
    ids=["1x8", "4x2", "1x2-mesh-changed"],
)
def test_a_two_process_checkpoint_resumes_on_other_process_counts(
    runs, tmp_path, processes, devices, extra
):
    out, expected, _ = resume(runs, tmp_path, processes, devices, *extra)
    assert_same_losses(losses(out), expected)


def test_a_mesh_change_needs_force(runs, tmp_path):
    root, recipe, _, _ = runs
    out = tmp_path / "run"
    shutil.copytree(root / "stopped", out)
    run = Run(
        recipe,
        out,
        1,
        2,
        "--no-progress",
        "--resume",
        "--set",
        "mesh.data=2",
        "--set",
        "mesh.fsdp=1",
    )
    [(status, _, err)] = run.wait()
    assert status == 2 and "mesh.data: 4 -> 2" in err and "--force" in err


def tamper_newest(checkpoints_dir: Path) -> None:
    """The newest checkpoint's recorded checksum of one array no longer matches its bytes."""
    steps = [p for p in checkpoints_dir.iterdir() if p.name.isdigit()]
    newest = max(steps, key=lambda p: int(p.name))
    for path in (newest / "meta").rglob("*"):
        if path.is_file() and '"fingerprints"' in path.read_text(errors="replace"):
            meta = json.loads(path.read_text())
            key = sorted(meta["fingerprints"])[0]
            meta["fingerprints"][key] ^= 1
            path.write_text(json.dumps(meta))


def test_a_damaged_checkpoint_on_a_two_process_resume_is_moved_aside_once(runs, tmp_path):
    root = runs[0]
    newest = checkpoints(root / "stopped")[-1]
    out, expected, results = resume(runs, tmp_path, 2, 4, damage=tamper_newest)
    lines = [line for _, o, e in results for line in (o + e).splitlines()]
    warnings = [line for line in lines if "is damaged" in line]
    assert len(warnings) == 1
    assert f"checkpoint {out / 'checkpoints' / newest} is damaged" in warnings[0]
    assert not warnings[0].startswith("[process")  # said by process 0
    assert (out / "checkpoints" / f"{newest}.damaged").is_dir()
    assert not (out / "checkpoints" / f"{newest}.damaged2").exists()
    assert_same_losses(losses(out), expected)


def test_a_killed_process_stops_the_other_within_the_bound(runs, tmp_path):
    _, recipe, expected, _ = runs
    out = tmp_path / "run"
    lost_after = 20  # short, but above start-up differences on a busy machine
    run = Run(recipe, out, 2, 4, "--no-progress", "--lost-after", str(lost_after))
    run.wait_for_rows(5)
    run.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    (status0, out0, err0), (status1, _, _) = run.wait(timeout=lost_after + 60)
    assert time.monotonic() - killed < lost_after + 60
    assert status1 == -signal.SIGKILL
    assert status0 == 1, (out0 + err0)[-3000:]
    message = next(line for line in err0.splitlines() if "was lost" in line)
    assert "process 1 of 2 was lost" in message and "no heartbeat" in message
    # The checkpoint it names is complete: the run resumes from it and ends as if never stopped.
    named = int(re.search(r"last complete checkpoint is step (\d+)", message).group(1))
    assert named == int(checkpoints(out)[-1])
    finished(Run(recipe, out, 2, 4, "--no-progress", "--resume"))
    assert_same_losses(losses(out), expected)
