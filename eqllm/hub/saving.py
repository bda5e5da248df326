"""Saving a CausalLM as a Hugging Face checkpoint (and, through one, as a GGUF file): one
tensor at a time, in transformers' names and layouts from the family's key table
(`eqllm/families/`), a muP model's multipliers folded into its weights first."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from eqllm.config import DType
from eqllm.data.tokenizer import Tokenizer
from eqllm.families import Row
from eqllm.hub.config import to_hf_config
from eqllm.hub.files import PlannedTensor, parse_size, shard, write_file
from eqllm.hub.fold import fold_multipliers
from eqllm.hub.folders import INDEX, host_leaves, save_tokenizer, skeleton
from eqllm.hub.gguf import check_exportable, folder_to_gguf
from eqllm.hub.tables import (
    axis_slice,
    fused_order,
    hf_shape,
    indices,
    part_names,
    rows_for,
    stack_layers,
    tensor_name,
)
from eqllm.model import CausalLM, dtype_of


def _slice(whole, row: Row, start: int, size: int):
    """The writer of one part of a row stored as several tensors (`Row.parts`)."""
    return lambda: np.ascontiguousarray(axis_slice(whole(), row.axis, start, start + size))


def save_pretrained(
    model: CausalLM,
    directory: str | os.PathLike,
    *,
    tokenizer: Tokenizer | None = None,
    max_shard_size: int | str = "5GB",
    dtype: DType | None = None,
) -> Path:
    """Write `model` as a Hugging Face checkpoint that transformers' from_pretrained loads.

    Writes config.json and model.safetensors, or shards model-0000k-of-0000n.safetensors with
    model.safetensors.index.json when the weights exceed `max_shard_size` (bytes or '5GB').
    Older weight files of the folder are removed. `tokenizer` (an eqllm Tokenizer) is saved
    beside them. `dtype` casts the weights (default: the model's parameter dtype). A muP or
    CompleteP model's multipliers are folded into the weights (`eqllm.hub.fold`).
    Returns the folder.
    """
    model = fold_multipliers(model)  # muP / CompleteP: the same logits from SP weights
    config = model.config
    dtype = dtype or config.param_dtype
    hf_config = to_hf_config(config)  # raises for configs transformers cannot express
    hf_config["torch_dtype"] = dtype
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = np.dtype(dtype_of(dtype))
    leaves, _ = skeleton(config)
    rows = rows_for(config.family, set(leaves))
    host = host_leaves(model)

    def make(row: Row, index: tuple[int, ...]):
        def tensor() -> np.ndarray:
            parts = [host[p][index] for p in row.eqllm]
            out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=row.axis)
            order = fused_order(row, [p.shape[row.axis] for p in parts], config.at(row.heads))
            if order is not None:  # the parts one after the other -> interleaved per head
                out = np.take(out, order, axis=row.axis)
            if row.conv1d and out.ndim == 2:
                out = out.T
            if row.transposed:
                out = np.swapaxes(out, -1, -2)
            if row.depthwise:
                out = out[:, None]  # (channels, kernel) -> torch's (channels, 1, kernel)
            return np.ascontiguousarray(out, dtype=target)

        return tensor

    planned = []

    def plan(row: Row, index: tuple[int, ...]) -> None:
        lead = int(row.layered) + int(row.per_expert)
        shapes = [leaves[p].shape[lead:] for p in row.eqllm]
        name = tensor_name(row, index, stack_layers(row, config))
        if not row.parts:
            planned.append(PlannedTensor(name, hf_shape(row, shapes), target, make(row, index)))
            return
        whole, start = make(row, index), 0
        for part, (_, path) in zip(part_names(row, name), row.parts, strict=True):
            size = leaves[path].shape[lead + row.axis]
            shape = list(hf_shape(row, shapes))
            shape[row.axis] = size
            planned.append(
                PlannedTensor(part, tuple(shape), target, _slice(whole, row, start, size))
            )
            start += size

    spans = {row: stack_layers(row, config) for row in rows}
    every = {row: indices(row, len(spans[row]), config.at("moe.n_experts")) for row in rows}
    for i in range(config.n_layers):  # layer-major order, as transformers writes
        for row in rows:
            for index in every[row] if row.layered else []:
                if spans[row][index[0]] == i:
                    plan(row, index)
    for row in rows:
        if not row.layered:
            for index in every[row]:
                plan(row, index)
    _write_weights(folder, planned, parse_size(max_shard_size))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    return folder


def _write_weights(folder: Path, planned: list[PlannedTensor], max_shard_size: int) -> None:
    groups = shard(planned, max_shard_size)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX]:
        if stale.name not in names and stale.exists():
            stale.unlink()
    for name, group in zip(names, groups, strict=True):
        write_file(folder / name, group, {"format": "pt"})
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in planned)},
            "weight_map": {t.name: n for n, g in zip(names, groups, strict=True) for t in g},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def save_gguf(
    model: CausalLM,
    path: str | os.PathLike,
    *,
    tokenizer: Tokenizer | None = None,
    type: str = "f16",
) -> Path:
    """Write `model` (and `tokenizer`, with its chat template) as a GGUF file whose 2-D weights
    are `type` ('f32', 'f16', 'bf16' or 'q8_0'); llama.cpp and ollama run it."""
    check_exportable(model.config, type)  # before writing anything
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, dtype="float32")
        return folder_to_gguf(Path(tmp), Path(path), model.config, tokenizer, type)
