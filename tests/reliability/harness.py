"""Shared pieces of the fault tests: a tiny corpus and recipe, `eqllm run` as a killable child."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from eqllm.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("child.py")
TINY_MODEL = {
    "d_model": 32,
    "n_layers": 2,
    "attention": {"n_heads": 4, "n_kv_heads": 2},
    "mlp": {"d_ff": 64},
    "max_seq_len": 64,
}


def make_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "value", "class", "for", "in", "if", "None"]
    for i in range(30):
        lines = [" ".join(rng.choice(words, 6)) + ":" for _ in range(40)]
        (corpus / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    return corpus


def tiny_recipe(root: Path, corpus: Path, *, tokenizer: str = "bytes", **train) -> Recipe:
    values = {
        "name": "tiny",
        "model": {"variant": "llama-nano", "overrides": TINY_MODEL},
        "data": {
            "source": {"kind": "files", "path": str(corpus)},
            "tokenizer": tokenizer,
            "seq_len": 32,
            "val_fraction": 0.1,
            "cache_dir": str(root / "tokens"),
            **({"bpe_vocab_size": 300} if tokenizer == "bpe" else {}),
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {
            "batch_size": 8,
            "steps": 30,
            "log_every": 1,
            "eval_every": 7,
            "checkpoint_every": 5,
            "keep_checkpoints": 3,
            "compile_cache": str(root / "jax"),
            **train,
        },
        "eval": {"batches": 2, "sample_tokens": 4, "sample_prompts": ["def "]},
    }
    return Recipe.from_dict(values)


def write_recipe(path: Path, recipe: Recipe) -> Path:
    path.write_text(recipe.to_toml())
    return path


def start(recipe: Path, out: Path, *, pause: str | None = None, marker: Path | None = None):
    """`eqllm run RECIPE --out OUT` in a child process (with --resume once OUT holds a run)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "EQLLM_CACHE": str(recipe.parent / "cache")}
    env.pop("EQLLM_PAUSE", None)
    if pause:
        env["EQLLM_PAUSE"], env["EQLLM_PAUSE_MARKER"] = pause, str(marker)
    args = [sys.executable, str(CHILD), "run", str(recipe), "--out", str(out), "--no-progress"]
    if (out / "config.toml").is_file():
        args.append("--resume")
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def n_rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text(errors="replace").count("\n") if path.is_file() else 0


def checkpoint_write_in_progress(out: Path, since: float) -> bool:
    """Whether a checkpoint temporary folder was written to after `since` (time.time())."""
    folder = out / "checkpoints"
    return folder.is_dir() and any(
        "tmp" in p.name and p.stat().st_mtime >= since for p in folder.iterdir()
    )


def kill_at(recipe: Path, out: Path, plan, *, rng=None, timeout: float = 240) -> dict:
    """Run to the end, killed with SIGKILL once per item of `plan` and resumed each time.

    An item is "PHASE:N" (kill while paused at that point, see child.py) or a float (kill that
    many seconds after this process logged its first metrics row). Returns counts: kills,
    kills during a checkpoint write, and the final child's output.
    """
    stats = {"kills": 0, "during_checkpoint_write": 0, "phases": [], "resumes": []}
    killed_at = None  # (last step logged before the latest kill, whether a save was in flight)

    def resumed(output: str) -> None:
        """Record (last step logged, save in flight, step the next process resumed at)."""
        if killed_at is not None:
            found = re.search(r"resuming at step (\d+)", output)
            stats["resumes"].append((*killed_at, int(found.group(1)) if found else None))

    for item in plan:
        marker = out.parent / f"{out.name}.paused"
        marker.unlink(missing_ok=True)
        rows_before = n_rows(out)
        pause = item if isinstance(item, str) else None
        started = time.time()
        proc = start(recipe, out, pause=pause, marker=marker)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            if pause and marker.exists():
                break
            if not pause and n_rows(out) > rows_before:
                time.sleep(float(item))
                break
            time.sleep(0.05)
        if proc.poll() == 0 and not pause:  # finished within the random delay: no kill
            resumed(proc.stdout.read().decode())
            proc.stdout.close()
            stats["finished_before_kill"] = stats.get("finished_before_kill", 0) + 1
            killed_at = None
            continue
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended before the kill {item!r}: {proc.stdout.read().decode()[-3000:]}"
            )
        if time.monotonic() - t0 >= timeout:
            proc.kill()
            raise AssertionError(f"kill {item!r}: the run never reached that point")
        in_write = checkpoint_write_in_progress(out, started)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        resumed(proc.stdout.read().decode())
        proc.stdout.close()
        killed_at = (last_step(out), bool(in_write))
        stats["kills"] += 1
        stats["during_checkpoint_write"] += in_write
        stats["phases"].append(pause.split(":")[0] if pause else f"random {float(item):.2f}s")
    proc = start(recipe, out)
    output = proc.communicate(timeout=timeout)[0].decode()
    assert proc.returncode == 0, output[-3000:]
    resumed(output)
    stats["output"] = output
    return stats


def last_step(out: Path) -> int:
    """The last training step metrics.jsonl records (0 when none)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [0]
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if "loss" in row:
            steps.append(row["step"])
    return max(steps)


def check_resumes(stats: dict, checkpoint_every: int) -> None:
    """Every restart resumed from a checkpoint, redoing at most `checkpoint_every` steps.

    A kill while a checkpoint was being written loses that one (it is committed atomically or
    not at all), so up to twice `checkpoint_every` steps are redone then. A restart from step 0
    after training had passed a checkpoint (a resume that silently started over) fails here,
    though its final losses would be the same.
    """
    assert stats["resumes"], "no restart was recorded"
    for killed_at, in_write, resumed_at in stats["resumes"]:
        resumed_at = resumed_at or 0  # no "resuming at": started from step 0
        assert resumed_at <= killed_at and resumed_at % checkpoint_every == 0, (
            killed_at,
            resumed_at,
        )
        allowed = checkpoint_every * (2 if in_write else 1)
        assert killed_at - resumed_at <= allowed, (
            f"killed after step {killed_at}{' during a checkpoint write' if in_write else ''}, "
            f"resumed at step {resumed_at}: more than {allowed} steps redone"
        )


def curves(out: Path) -> dict[tuple[int, str], float]:
    """{(step, key): value} of every loss-like entry of metrics.jsonl; no (step, key) twice."""
    found: dict[tuple[int, str], float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key == "loss" or key.startswith("val/"):
                where = (row["step"], key)
                assert where not in found, f"metrics.jsonl has {where} twice"
                found[where] = value
    return found
