"""One loader for every place a model can come from.

`load(spec)` accepts a zoo name (fresh weights), a run folder written by `eqllm run` (its latest
checkpoint, or `step`), one of its checkpoints (`RUN/checkpoints/STEP`), an eqllm model folder,
or a Hugging Face folder / hub repo id. `eqllm generate`, `eqllm eval` and `eqllm convert` all
go through it, so each accepts all of these.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from eqllm.config import ModelConfig
from eqllm.data import Tokenizer
from eqllm.model import CausalLM


def run_folder_of(spec: str | os.PathLike) -> tuple[Path, int | None] | None:
    """(run folder, step or None) when `spec` is a run folder or one of its checkpoints."""
    path = Path(spec).expanduser()
    if (path / "config.toml").is_file() and (path / "checkpoints").is_dir():
        return path, None
    if path.parent.name == "checkpoints" and path.name.isdigit():
        if (path.parent.parent / "config.toml").is_file():
            return path.parent.parent, int(path.name)
    return None


def load_run(run_dir: Path, step: int | None = None, overrides: list[str] | None = None):
    """(model, tokenizer, recipe, checkpoint meta) of a run folder at `step` (default latest)."""
    from eqllm.recipe import load_recipe
    from eqllm.train.loop import build_model, restore_model

    recipe = load_recipe(run_dir / "config.toml", overrides or [])
    tokenizer_file = run_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"run folder {run_dir} has no tokenizer.json; it was not written by `eqllm run` or "
            "is incomplete"
        )
    tokenizer = Tokenizer.load(tokenizer_file)
    config_file = run_dir / "model_config.json"
    if config_file.is_file():  # the template's weights are replaced by the checkpoint's
        config = ModelConfig.from_dict(json.loads(config_file.read_text()))
        model = CausalLM(config, key=jax.random.key(0))
    else:
        model = build_model(recipe, tokenizer.vocab_size)
    model, meta = restore_model(run_dir / "checkpoints", model, recipe, step)
    return model, tokenizer, recipe, meta


def load(
    spec: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    local_files_only: bool = False,
) -> tuple[CausalLM, Tokenizer | None]:
    """(model, tokenizer or None) from any of the sources the module docstring lists."""
    from eqllm import hub

    run = run_folder_of(spec)
    if run is not None:
        model, tokenizer, _, _ = load_run(run[0], step if step is not None else run[1])
        if dtype is not None:
            model = hub.with_param_dtype(model, dtype)
        return model, tokenizer
    return hub.load_any(
        spec, dtype=dtype, key=jax.random.key(seed), local_files_only=local_files_only
    )
