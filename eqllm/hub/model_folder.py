"""eqllm model folders (any config, exportable to Hugging Face or not), and loading a model
from whatever a user names: a zoo variant, a Hugging Face folder or repo, an eqllm folder."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
from jaxtyping import PRNGKeyArray

from eqllm import zoo
from eqllm.config import DType, ModelConfig
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub.files import CheckpointError, PlannedTensor, TensorReader, write_file
from eqllm.hub.folders import host_leaves, load_tokenizer, resolve, save_tokenizer, skeleton
from eqllm.hub.gguf import gguf_to_folder, is_gguf
from eqllm.hub.pretrained import from_pretrained
from eqllm.model import CausalLM, dtype_of

EQLLM_CONFIG = "eqllm_config.json"


def save_model(
    model: CausalLM, directory: str | os.PathLike, *, tokenizer: Tokenizer | None = None
) -> Path:
    """Write an eqllm model folder: eqllm_config.json (ModelConfig) + model.safetensors.

    Tensors are the eqllm arrays as they are (layers stacked), named by their pytree path
    (e.g. 'blocks.attn.q_proj.weight'). Any config can be saved, exportable to HF or not.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    host = host_leaves(model)
    planned = [
        PlannedTensor(name, a.shape, a.dtype, lambda a=a: a) for name, a in sorted(host.items())
    ]
    write_file(folder / "model.safetensors", planned, {"format": "eqllm"})
    config_text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    (folder / EQLLM_CONFIG).write_text(config_text)
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    return folder


def load_model(directory: str | os.PathLike) -> CausalLM:
    """Read an eqllm model folder written by `save_model`."""
    folder = Path(directory)
    config_file = folder / EQLLM_CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"no {EQLLM_CONFIG} in {folder}: not an eqllm model folder")
    config = ModelConfig.from_dict(json.loads(config_file.read_text()))
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"no model.safetensors in {folder}")
    leaves, treedef = skeleton(config)
    arrays = []
    with TensorReader([weights]) as reader:
        extra = sorted(set(reader.tensors) - set(leaves))
        if extra:
            raise CheckpointError(f"{weights}: tensors {extra} are not in the model {config}")
        for path, leaf in leaves.items():
            if path not in reader:
                raise CheckpointError(f"{weights}: tensor {path!r} is missing")
            info = reader.tensors[path]
            if info.shape != leaf.shape or info.dtype != leaf.dtype:
                raise CheckpointError(
                    f"{weights}: tensor {path!r} is {list(info.shape)} {info.dtype}, the "
                    f"config in {EQLLM_CONFIG} needs {list(leaf.shape)} {leaf.dtype}"
                )
            arrays.append(jax.device_put(reader.read(path)))
    return jax.tree_util.tree_unflatten(treedef, arrays)


def with_param_dtype(model: CausalLM, dtype: DType) -> CausalLM:
    """The model with its parameters (and compute dtype) cast to `dtype`."""
    if dtype == model.config.param_dtype == model.config.compute_dtype:
        return model
    config = model.config.replace(param_dtype=dtype, compute_dtype=dtype)
    _, treedef = skeleton(config)
    return jax.tree_util.tree_unflatten(
        treedef, [leaf.astype(dtype_of(dtype)) for leaf in jax.tree.leaves(model)]
    )


def is_model_folder(path: Path) -> bool:
    return (path / EQLLM_CONFIG).is_file()


def load_any(
    spec: str | os.PathLike,
    *,
    dtype: DType | None = None,
    key: PRNGKeyArray | None = None,
    local_files_only: bool = False,
) -> tuple[CausalLM, Tokenizer | None]:
    """(model, tokenizer or None) from a zoo name, an HF folder or repo id, or an eqllm folder.

    A zoo name builds fresh weights from `key` (default `jax.random.key(0)`) and has no
    tokenizer; a folder or repo gives its tokenizer when it holds tokenizer.json.
    """
    text = os.fspath(spec)
    if not Path(text).expanduser().exists() and "/" not in text:
        zoo.entry(text)  # neither a folder nor 'org/name': an unknown zoo name, "did you mean"
    if not Path(text).expanduser().exists() and text in zoo.names():
        config = zoo.config(text)
        if dtype is not None:
            config = config.replace(param_dtype=dtype, compute_dtype=dtype)
        return CausalLM(config, key=jax.random.key(0) if key is None else key), None
    if is_gguf(text):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = gguf_to_folder(text, tmp)
            return from_pretrained(tmp, dtype=dtype or "float32"), tokenizer
    try:
        folder = resolve(text, local_files_only=local_files_only)
    except CheckpointError as e:
        raise CheckpointError(
            f"{text!r} is not a zoo name (`eqllm zoo list`), an existing folder or a hub repo id "
            f"('org/name'): {e}"
        ) from None
    if is_model_folder(folder):
        model = load_model(folder)
        if dtype is not None:
            model = with_param_dtype(model, dtype)
    else:
        model = from_pretrained(folder, dtype=dtype)
    return model, load_tokenizer(folder)
