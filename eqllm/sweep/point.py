"""One point of a sweep: an ordinary run folder, resumed where it stopped, watched for divergence.

Besides what `eqllm run` writes, a point folder holds point.json (its overrides),
sweep_state.json (its first loss and the seconds spent so far) and, once it finished or
diverged, result.json: its line of results.jsonl. A point with result.json is never rerun.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import equinox as eqx
import jax

from eqllm.config import ModelConfig
from eqllm.model import CausalLM
from eqllm.nn import Embedding
from eqllm.recipe import Recipe
from eqllm.runs import RunFolder
from eqllm.sweep.spec import Point, Sweep, SweepError
from eqllm.train.loop import NonFiniteLoss, run
from eqllm.train.metrics import read_rows
from eqllm.trees import param_count


def write_json(path: Path, value) -> None:
    """Write JSON atomically (a temporary file renamed), so a kill never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


class Divergence:
    """The `watch` of a point's run: diverged once a loss is non-finite or above
    `factor` x the first step's loss (the loss of the initial model). Keeps the first loss and
    the seconds spent in sweep_state.json, so a resumed point compares with the same loss."""

    def __init__(self, folder: Path, factor: float):
        self.path = folder / "sweep_state.json"
        self.state = read_json(self.path) or {"initial_loss": None, "seconds": 0.0}
        self.factor = factor
        self.diverged = False
        self.step = 0  # the last step watched
        self.started = time.perf_counter()
        self.saved = self.started

    def __call__(self, step: int, loss: float) -> bool:
        self.step = step
        if self.state["initial_loss"] is None:
            self.state["initial_loss"] = loss if math.isfinite(loss) else None
            self.save()
        first = self.state["initial_loss"]
        if not math.isfinite(loss) or first is None or loss > self.factor * first:
            self.diverged = True
        if time.perf_counter() - self.saved > 30:  # a killed sweep keeps most of its seconds
            self.save()
        return self.diverged

    def seconds(self) -> float:
        return self.state["seconds"] + time.perf_counter() - self.started

    def save(self) -> None:
        now = time.perf_counter()
        self.state["seconds"] += now - self.started
        self.started = self.saved = now
        write_json(self.path, self.state)


def run_point(sweep: Sweep, point: Point, out: Path, *, progress: bool = False, echo=print):
    """Run (or resume, or skip when finished) one point; its result row, or None when a signal
    stopped it (the run then has a checkpoint to resume from). Returns (row, interrupted)."""
    folder = out / point.name
    done = read_json(folder / "result.json")
    if done is not None:
        return done, None
    recipe = sweep.point_recipe(point)
    folder.mkdir(parents=True, exist_ok=True)
    saved = read_json(folder / "point.json")
    if saved is not None and saved["settings"] != point.settings:
        raise SweepError(
            f"{folder} holds point {saved['settings']}, but the sweep file now gives "
            f"{point.settings} for it; restore the sweep file or use another --out"
        )
    write_json(folder / "point.json", {"index": point.index, "settings": point.settings})
    ckpt = folder / "checkpoints"
    resume = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    watch = Divergence(folder, sweep.diverge_factor)
    echo(f"point {point.name} {point.settings}" + (" (resuming)" if resume else ""))
    try:
        result = run(recipe, folder, resume=resume, progress=progress, echo=_quiet, watch=watch)
    except NonFiniteLoss:
        watch.diverged = True
        result = None
    watch.save()
    if result is not None and result.interrupted in ("SIGINT", "SIGTERM"):
        return None, result.interrupted
    row = result_row(
        recipe, point, folder, diverged=watch.diverged, seconds=watch.seconds(), step=watch.step
    )
    write_json(folder / "result.json", row)
    status = "diverged" if row["diverged"] else f"loss {row['loss']:.4f}"
    echo(f"point {point.name}: {status} ({row['seconds']:.0f} s)")
    return row, None


def _quiet(message: str) -> None:
    pass


def result_row(
    recipe: Recipe, point: Point, folder: Path, *, diverged: bool, seconds: float, step: int = 0
):
    """The point's line of results.jsonl (from its run folder's metrics and summary; `step`:
    the last step this process watched, where a diverged point stopped)."""
    cfg = _config(recipe, folder)
    rows = read_rows(RunFolder(folder).metrics_file)
    val = [r["val/loss"] for r in rows if "val/loss" in r and math.isfinite(r["val/loss"])]
    summary = read_json(RunFolder(folder).summary_file) or {}
    loss = summary.get("val", {}).get("loss") if not diverged else None
    if loss is not None and not math.isfinite(loss):
        loss, diverged = None, True
    steps = max([step, *(r["step"] for r in rows if "step" in r)])
    tokens = steps * recipe.tokens_per_step()
    params, non_embedding = count_params(cfg)
    return {
        "point": point.name,
        "settings": point.settings,
        "lr": recipe.optim.lr,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "parametrization": cfg.parametrization,
        "params": params,
        "non_embedding_params": non_embedding,
        "steps": steps,
        "tokens": tokens,
        "flops": cfg.flops_per_token(recipe.data.seq_len) * tokens,
        "loss": loss,
        "best_loss": min(val) if val else None,
        "diverged": diverged,
        "seconds": seconds,
    }


def _config(recipe: Recipe, folder: Path) -> ModelConfig:
    """The config the point trained (model_config.json: the vocabulary follows the tokenizer)."""
    run = RunFolder(folder)
    has_config = run.file(RunFolder.MODEL_CONFIG_FILE).is_file()
    return run.model_config() if has_config else recipe.model_config()


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding tables), from shapes alone. A tied
    table is the head too; it is left out all the same (Kaplan et al.'s N)."""
    shapes = eqx.filter_eval_shape(CausalLM, cfg, key=jax.random.key(0))
    tables = [x for x in jax.tree.leaves(shapes, is_leaf=_is_embedding) if _is_embedding(x)]
    params = param_count(shapes)
    return params, params - sum(param_count(t) for t in tables)


def _is_embedding(x) -> bool:
    return isinstance(x, Embedding)
