"""Several processes, one machine: `eqllm run --coordinator/--num-processes/--process-id`.

Two processes of 4 simulated CPU devices each (jax.distributed over gloo) train the same run as
one process of 8 devices; a checkpoint the two wrote is resumed by one process. Slow (three
runs in child processes, about a minute): `pytest -m slow tests/test_multiprocess.py`.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eqllm.recipe import Recipe
from tests.reliability.harness import make_corpus, tiny_recipe

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def eqllm_run(recipe: Path, out: Path, devices: int, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "EQLLM_CACHE": str(recipe.parent / "cache"),
    }
    args = [sys.executable, "-m", "eqllm.cli", "run", str(recipe), "--out", str(out)]
    return subprocess.Popen(
        [*args, "--no-progress", *extra],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(*procs: subprocess.Popen) -> None:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-4000:]


def losses(out: Path) -> tuple[int, dict[int, float]]:
    """(rows other than compile-time ones, which a resumed run adds once more; step -> loss)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if "compile_s" not in r]
    return len(measured), {r["step"]: r["loss"] for r in rows if "loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_train_as_one_and_their_checkpoint_resumes_in_one(tmp_path):
    values = tiny_recipe(
        tmp_path, make_corpus(tmp_path), steps=6, eval_every=3, checkpoint_every=3
    ).to_dict()
    values["mesh"] = {"data": 4, "fsdp": 2}  # data crosses the processes, fsdp stays inside
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(Recipe.from_dict(values).to_toml())

    finish(eqllm_run(recipe, tmp_path / "one", 8))
    port = free_port()
    finish(
        *(
            eqllm_run(
                recipe,
                tmp_path / "two",
                4,
                *("--coordinator", f"localhost:{port}"),
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            )
            for i in range(2)
        )
    )
    rows_one, one = losses(tmp_path / "one")
    rows_two, two = losses(tmp_path / "two")
    assert rows_two == rows_one  # process 1 wrote no rows of its own
    assert sorted(two) == list(range(1, 7))
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-5)
    assert (tmp_path / "two" / "report.md").is_file()

    # One process resumes the two processes' step-3 checkpoint and redoes steps 4-6.
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "6")
    finish(eqllm_run(recipe, tmp_path / "two", 8, "--resume"))
    rows_resumed, resumed = losses(tmp_path / "two")
    assert rows_resumed == rows_one
    np.testing.assert_allclose([resumed[s] for s in one], list(one.values()), rtol=1e-5)
