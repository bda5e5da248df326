"""Where checkpoints live and what every folder format shares.

A Hugging Face folder holds config.json + *.safetensors (+ tokenizer files); an eqllm model
folder holds eqllm_config.json + model.safetensors. Hub repo ids are downloaded into the hub
cache first.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from huggingface_hub import snapshot_download

from eqllm import zoo
from eqllm.config import ModelConfig, dotted
from eqllm.data.tokenizer import Tokenizer, tiktoken_refusal
from eqllm.hub.files import CheckpointError
from eqllm.model import EXECUTION_FIELDS, CausalLM

log = logging.getLogger("eqllm.hub")

INDEX = "model.safetensors.index.json"
# What a hub download fetches: the config, the weights and the tokenizer files.
_HUB_FILES = [
    "config.json",
    "*.safetensors",
    INDEX,
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
]

# Locating checkpoints ------------------------------------------------------------------------


def resolve(
    path_or_repo_id: str | os.PathLike,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    files: list[str] | None = None,
) -> Path:
    """A local folder for `path_or_repo_id`: the folder itself, or the hub snapshot of a repo
    (of `files`, glob patterns; default: a model's config, weights and tokenizer)."""
    spec = os.fspath(path_or_repo_id)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; give the folder that holds config.json")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise CheckpointError(
            f"{spec!r} is neither an existing folder nor a hub repo id of the form 'org/name'"
        )
    try:
        return Path(
            snapshot_download(
                spec,
                revision=revision,
                allow_patterns=files or _HUB_FILES,
                local_files_only=local_files_only,
            )
        )
    except Exception as e:
        offline = " (it is not in the local cache)" if local_files_only else ""
        raise CheckpointError(
            f"could not get the Hugging Face hub repo {spec!r}{offline}: {type(e).__name__}: {e}"
        ) from e


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard file(s) that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = (
            f"; it has PyTorch pickles {other}: re-save them as safetensors with "
            "transformers (model.save_pretrained(folder)), eqllm does not read pickles"
            if other
            else ""
        )
        raise CheckpointError(f"no *.safetensors weights in {folder}{hint}")
    return files


def read_hf_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"no config.json in {folder}: a Hugging Face checkpoint folder holds config.json "
            "and *.safetensors (an eqllm model folder holds eqllm_config.json)"
        )
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None


def zoo_match(config: ModelConfig) -> str | None:
    """The zoo variant with the same architecture as `config` (dtypes and execution aside)."""
    ignore = {*EXECUTION_FIELDS, "param_dtype", "init_std"}

    def key(cfg: ModelConfig) -> dict:
        return {k: v for k, v in dotted(cfg.to_dict()).items() if k not in ignore}

    wanted = key(config)
    return next((name for name in zoo.names() if key(zoo.config(name)) == wanted), None)


def skeleton(config: ModelConfig):
    """(leaf path -> ShapeDtypeStruct, treedef) of CausalLM(config), allocating nothing."""
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    paths = {jax.tree_util.keystr(p, simple=True, separator="."): leaf for p, leaf in flat}
    return paths, treedef


def host_leaves(model: CausalLM) -> dict[str, np.ndarray]:
    """Leaf path -> numpy array (a view of the JAX buffer on CPU; a host copy otherwise)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in flat
    }


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads too."""
    tokenizer.save(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer saved in `folder` (tokenizer.json or a SentencePiece tokenizer.model, with
    tokenizer_config.json and the chat template), if any. A tiktoken.model alone is not read:
    the model loads without a tokenizer (prompts as token ids) and a warning names the fix."""
    if not (folder / "tokenizer.json").is_file() and (folder / "tiktoken.model").is_file():
        log.warning("%s", tiktoken_refusal(folder))
        return None
    has = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    return Tokenizer.load(folder) if has else None
