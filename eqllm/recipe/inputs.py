"""What a recipe names outside itself: data files, tokenizers and text sources, found and
checked. A run folder's saved recipe is read without these checks (its data may be elsewhere)."""

from __future__ import annotations

import glob
from pathlib import Path

from eqllm.data.tokenizer import tiktoken_refusal
from eqllm.recipe.errors import RecipeError
from eqllm.recipe.sections import FinetuneSpec, PreferenceSpec, RLSpec, SourceSpec
from eqllm.resources import data_dir


def finetune_data_path(spec: str) -> Path | None:
    """The instruction file `spec` names: a path, else one under the shipped recipes folder."""
    for path in (Path(spec).expanduser(), data_dir("recipes") / spec):
        if path.is_file():
            return path
    return None


def preference_data_source(spec: str) -> str | Path | None:
    """What preference.data reads: "hf:NAME" as it is, a dataset folder, else a file (found
    like finetune.data); None when there is none."""
    if spec.startswith("hf:"):
        return spec
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    return finetune_data_path(spec)


def source_label(spec: SourceSpec, index: int) -> str:
    """The name of a source in metrics and reports: its label, else its path or hub name."""
    return spec.label or spec.path or spec.name or f"source{index}"


def check_data_files(f: FinetuneSpec, p: PreferenceSpec, r: RLSpec) -> None:
    """The files of finetune.data, preference.data and rl.data exist."""
    if r.data and finetune_data_path(r.data) is None:
        raise RecipeError(
            f"rl.data={r.data!r} does not exist (in the working directory or among eqllm's "
            "shipped recipes); point it at a JSONL file of prompts"
        )
    if p.data and preference_data_source(p.data) is None:
        raise RecipeError(
            f"preference.data={p.data!r} does not exist (in the working directory or among "
            "eqllm's shipped recipes); point it at a JSONL file of preference pairs, a "
            "dataset folder or file, or 'hf:NAME'"
        )
    if f.data and finetune_data_path(f.data) is None:
        raise RecipeError(
            f"finetune.data={f.data!r} does not exist (in the working directory or among "
            "eqllm's shipped recipes); point it at a JSON/JSONL file of examples"
        )


def check_tokenizer(spec: str) -> None:
    """data.tokenizer is a built-in, an existing tokenizer file or folder, or a hub repo id."""
    if spec in ("bytes", "bpe"):
        return
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            if (path / "tiktoken.model").is_file():
                raise RecipeError(f"data.tokenizer: {tiktoken_refusal(path)}")
            raise RecipeError(f"data.tokenizer={spec!r}: folder has no tokenizer.json")
        return
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise RecipeError(
            f"data.tokenizer={spec!r} is not 'bytes', 'bpe', an existing tokenizer.json path or "
            "folder, or a hub repo id (org/name)"
        )


def check_source(spec: SourceSpec, key: str) -> None:
    """The source at `key` is one DataSource accepts, and its files exist."""
    try:
        spec.to_source()
    except ValueError as e:  # DataSource's own rules (a `files` source needs a path, ...)
        raise RecipeError(f"{key}: {e}") from None
    if spec.kind in ("files", "jsonl"):
        if not (Path(spec.path).expanduser().exists() or glob.glob(spec.path)):
            raise RecipeError(
                f"{key}.path={spec.path!r} does not exist; point it at a file, folder or glob "
                "pattern of text"
            )
