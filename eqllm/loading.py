"""One loader for every place a model can come from.

`load(spec)` accepts a zoo name (fresh weights), a run folder written by `eqllm run` (its latest
checkpoint, or `step`), one of its checkpoints (`RUN/checkpoints/STEP`), an eqllm model folder,
or a Hugging Face folder / hub repo id. `eqllm generate`, `eqllm eval` and `eqllm convert` all
go through it, so each accepts all of these. `convert(src, dst)` writes any of them as a
Hugging Face folder or an eqllm model folder.

Run folders are read through `eqllm.runs` (nothing outside the folder is needed), everything
else through `eqllm.hub`; no training code is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from eqllm import lora
from eqllm.config import DType
from eqllm.data import Tokenizer
from eqllm.data.chat import read_chat_template
from eqllm.data.instruct import ChatFormat
from eqllm.errors import EqllmError
from eqllm.hub import (
    load_any,
    save_adapter,
    save_gguf,
    save_model,
    save_pretrained,
    with_param_dtype,
    zoo_match,
)
from eqllm.hub.folders import resolve, save_tokenizer
from eqllm.hub.model_folder import is_model_folder
from eqllm.lora import adapters
from eqllm.model import CausalLM
from eqllm.recipe import Recipe
from eqllm.runs import RunFolder
from eqllm.trees import param_count


def run_folder_of(spec: str | os.PathLike) -> tuple[Path, int | None] | None:
    """(run folder, step or None) when `spec` is a run folder or one of its checkpoints."""
    run = RunFolder.of(spec)
    return None if run is None else (run[0].path, run[1])


def chat_format_of(spec: str, tokenizer: Tokenizer) -> ChatFormat:
    """The chat format of the model `spec` names: the chat template of its folder (or run
    folder) as transformers finds it, else eqllm's default (said once)."""
    run = run_folder_of(spec)
    folder = run[0] if run else (Path(spec) if Path(spec).is_dir() else None)
    return ChatFormat(tokenizer, read_chat_template(folder))


def load_run(
    run_dir: str | os.PathLike, step: int | None = None, overrides: list[str] | None = None
) -> tuple[CausalLM, Tokenizer, Recipe, dict]:
    """(model, tokenizer, recipe, checkpoint meta) of a run folder at `step` (default latest);
    the recipe with `overrides`, read without its data or tokenizer sources."""
    folder = RunFolder(run_dir)
    recipe = folder.recipe(overrides or [])
    tokenizer = folder.tokenizer()
    model, meta = folder.load_model(step)
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
    run = run_folder_of(spec)
    if run is not None:
        model, tokenizer, _, _ = load_run(run[0], step if step is not None else run[1])
        if dtype is not None:
            model = with_param_dtype(model, dtype)
        return model, tokenizer
    return load_any(spec, dtype=dtype, key=jax.random.key(seed), local_files_only=local_files_only)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str | None = None,
    dtype: DType | None = None,
    max_shard_size: int | str = "5GB",
    local_files_only: bool = False,
    merge: bool = False,
    gguf_type: str = "f16",
) -> str:
    """Convert the model (and tokenizer) at `src` into the folder `dst`; returns a summary.

    A `dst` ending in ``.gguf`` is written as one GGUF file (llama.cpp's format) with weights of
    `gguf_type` ('f32', 'f16', 'bf16', 'q8_0'), any LoRA adapters folded in.

    `to` is 'hf' or 'eqllm'; by default the other format than the source's (an HF folder or
    repo id becomes an eqllm model folder, an eqllm folder becomes an HF folder).
    A model with LoRA adapters (a LoRA run) is written as its adapter alone, in PEFT's format
    (with the tokenizer), or with `merge` as a Hugging Face folder with the adapters folded in.
    """
    run = run_folder_of(src)
    if str(dst).endswith(".gguf"):
        model, tokenizer = load(src, dtype=dtype, local_files_only=local_files_only)
        save_gguf(lora.merge(model), dst, tokenizer=tokenizer, type=gguf_type)
        return (
            f"wrote GGUF {dst}: {model.config.family}, {param_count(model):,} parameters, "
            f"{gguf_type} weights" + (", with tokenizer" if tokenizer is not None else "")
        )
    folder = run[0] if run else resolve(src, local_files_only=local_files_only)
    source_format = "eqllm" if run or is_model_folder(folder) else "hf"
    to = to or ("hf" if source_format == "eqllm" else "eqllm")
    if to not in ("hf", "eqllm"):
        raise EqllmError(f"to={to!r}: choose 'hf' or 'eqllm'")
    if Path(dst).resolve() == folder.resolve():
        raise EqllmError(f"destination {dst} is the source folder; write to another folder")
    model, tokenizer = load(src, dtype=dtype) if run else load_any(folder, dtype=dtype)
    if adapters(model) and not merge:
        save_adapter(model, dst)
        if tokenizer is not None:
            save_tokenizer(tokenizer, Path(dst))
        n = sum(a.lora_a.weight.size + a.lora_b.weight.size for a in adapters(model).values())
        return (
            f"wrote PEFT LoRA adapter {dst}: {len(adapters(model))} adapted projections, "
            f"{n:,} parameters (--merge writes the merged model instead)"
        )
    if merge and not adapters(model):
        raise EqllmError(f"--merge: {src} has no LoRA adapters to merge")
    model = lora.merge(model)
    if to == "hf":
        save_pretrained(model, dst, tokenizer=tokenizer, max_shard_size=max_shard_size)
    else:
        save_model(model, dst, tokenizer=tokenizer)
    cfg = model.config
    match = zoo_match(cfg)
    return (
        f"wrote {'Hugging Face' if to == 'hf' else 'eqllm'} folder {dst}: {cfg.family}, "
        f"{param_count(model):,} parameters, {cfg.param_dtype}"
        + (f", architecture of zoo variant {match}" if match else "")
        + (", with tokenizer" if tokenizer is not None else "")
    )
