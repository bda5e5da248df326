"""Hugging Face checkpoints loaded into a CausalLM (saving one: `eqllm.hub.saving`).

Loading builds the model's shape skeleton without allocating (`eqx.filter_eval_shape`), then
fills one leaf at a time from the safetensors files, stacking layer tensors into the leading
`layers` axis; each filled buffer is handed to JAX (on CPU without a copy), so the peak host
memory is one copy of the weights plus one leaf. The key table and config translation come
from the model's family file (`eqllm/families/`).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

import jax
import numpy as np

from eqllm import families
from eqllm.config import DType, ModelConfig
from eqllm.families import Row
from eqllm.hub.adapters import ADAPTER_FILES, load_adapter
from eqllm.hub.config import from_hf_config
from eqllm.hub.files import (
    CheckpointError,
    TensorReader,
    aligned_empty,
)
from eqllm.hub.folders import (
    read_hf_config,
    resolve,
    skeleton,
    weight_files,
    zoo_match,
)
from eqllm.hub.gguf import gguf_to_folder, is_gguf
from eqllm.hub.mxfp4 import dequantize
from eqllm.hub.tables import (
    BUFFERS,
    TIED_HEAD,
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

log = logging.getLogger("eqllm.hub")

_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(dtype_of("bfloat16")): "bfloat16",
    np.dtype(np.float16): "float16",
}


# Hugging Face format -------------------------------------------------------------------------


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: DType | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    adapter: str | os.PathLike | None = None,
) -> CausalLM:
    """A CausalLM with the weights of a Hugging Face checkpoint (folder or hub repo id).

    Arguments:
        path_or_repo_id: a folder with config.json and *.safetensors (one file, or shards with
            model.safetensors.index.json), or a hub repo id, downloaded into the hub cache.
        dtype: parameter dtype ('float32', 'bfloat16', 'float16'); None keeps the checkpoint's.
            The compute dtype is set to the same (change it with `model.with_config`).
        revision: passed to `huggingface_hub.snapshot_download`.
        local_files_only: passed to `huggingface_hub.snapshot_download`.
        adapter: a PEFT LoRA adapter folder (or hub repo id) to apply on top (see
            `eqllm.hub.adapters.load_adapter`); the model then holds `eqllm.lora` adapters.

    Raises CheckpointError naming the file and tensor for a missing, misshapen or unexpected
    tensor; ConfigError naming the field for an unsupported config.json.

    A GGUF file (llama.cpp's format) is read too: every tensor dequantized to float32
    (`eqllm.hub.gguf`), then cast to `dtype` if given.
    """
    if is_gguf(path_or_repo_id):
        with tempfile.TemporaryDirectory() as tmp:
            gguf_to_folder(path_or_repo_id, tmp)
            return from_pretrained(tmp, dtype=dtype or "float32", adapter=adapter)
    folder = resolve(path_or_repo_id, revision=revision, local_files_only=local_files_only)
    hf = read_hf_config(folder)
    try:
        config = from_hf_config(hf)
    except ValueError as e:
        raise type(e)(f"{folder}: {e}") from None
    with TensorReader(weight_files(folder)) as reader:
        if dtype is None:
            dtype = _checkpoint_dtype(reader, config.family)
        config = config.replace(param_dtype=dtype, compute_dtype=dtype)
        model = _load_hf_weights(config, reader)
    name = zoo_match(config)
    log.info(
        "loaded %s from %s%s",
        families.get(config.family).architecture,
        folder,
        f" (architecture of zoo variant {name})" if name else "",
    )
    if adapter is not None:
        adapter_folder = resolve(adapter, local_files_only=local_files_only, files=ADAPTER_FILES)
        model = load_adapter(model, adapter_folder)
    return model


def _checkpoint_dtype(reader: TensorReader, family: str) -> DType:
    """The dtype of the token embedding (float32 if it is missing or not a float type)."""
    embed = next((n for n in reader.tensors if n.endswith(families.get(family).embed_name)), None)
    if embed is None:
        return "float32"
    return _DTYPE_NAMES.get(reader.tensors[embed].dtype, "float32")  # type: ignore[return-value]


def _layout(config: ModelConfig, leaves, reader: TensorReader) -> list[Row]:
    """The rows of the family's first key table whose tensors the checkpoint holds (the main
    table when none fits: its missing tensor is then reported)."""
    family = families.get(config.family)
    for table in (family.table, *family.layouts):
        rows = rows_for(config.family, set(leaves), table)
        names = [
            part_names(r, tensor_name(r, indices(r, 1, 1)[0], stack_layers(r, config)))[0]
            for r in rows
        ]
        if all(n in reader or n.removeprefix(family.prefix) in reader for n in names):
            return rows
    return rows_for(config.family, set(leaves))


def _load_hf_weights(config: ModelConfig, reader: TensorReader) -> CausalLM:
    scaled = next((n for n in reader.tensors if n.endswith(".weight_scale_inv")), None)
    if scaled is not None:  # DeepSeek-V3's release: fp8 weights in 128 x 128 scaled blocks
        raise CheckpointError(
            f"{reader.tensors[scaled].file.name}: tensor {scaled!r} scales fp8 block-quantized "
            "weights, which eqllm does not read; cast the checkpoint to bf16 first (DeepSeek's "
            "inference/fp8_cast_bf16.py) and load that folder"
        )
    leaves, treedef = skeleton(config)
    rows = _layout(config, leaves, reader)
    prefix = families.get(config.family).prefix
    used: set[str] = set()

    def find(name: str) -> str:
        for candidate in (name, name.removeprefix(prefix)):
            if candidate in reader:
                used.add(candidate)
                return candidate
        files = sorted({i.file.name for i in reader.tensors.values()})
        raise CheckpointError(
            f"tensor {name!r} is missing from {', '.join(files)}, though config.json describes "
            f"a model that has it"
        )

    def quantized(name: str) -> np.ndarray | None:
        """The tensor dequantized from MXFP4 `name_blocks` / `name_scales`, if stored so."""
        for candidate in (name, name.removeprefix(prefix)):
            blocks, scales = f"{candidate}_blocks", f"{candidate}_scales"
            if blocks in reader and scales in reader:
                used.update((blocks, scales))
                return dequantize(reader.read(blocks), reader.read(scales), candidate)
        return None

    arrays: dict[str, jax.Array] = {}
    for row in rows:
        targets = [leaves[p] for p in row.eqllm]
        buffers = [aligned_empty(t.shape, t.dtype) for t in targets]
        lead = int(row.layered) + int(row.per_expert)  # leading axes indexed by the tensor name
        expected = hf_shape(row, [t.shape[lead:] for t in targets])
        order = fused_order(row, [t.shape[lead + row.axis] for t in targets], config.at(row.heads))
        layers = stack_layers(row, config)
        for index in indices(row, len(layers), config.at("moe.n_experts")):
            slots = [b[index] for b in buffers]
            name = tensor_name(row, index, layers)
            tensor = quantized(name)
            if tensor is not None:
                if tensor.shape != expected:
                    raise CheckpointError(
                        f"MXFP4 tensor {name!r} dequantizes to shape {list(tensor.shape)}, but "
                        f"config.json describes {list(expected)}"
                    )
            elif row.parts:  # stored as several tensors: read each, concatenated
                names = [find(n) for n in part_names(row, name)]
                tensor = np.concatenate([reader.read(n) for n in names], axis=row.axis)
                if tensor.shape != expected:
                    raise CheckpointError(
                        f"tensors {names} concatenate to shape {list(tensor.shape)}, but "
                        f"config.json describes {list(expected)}"
                    )
            else:
                name = find(name)
                info = reader.tensors[name]
                if info.shape != expected:
                    raise CheckpointError(
                        f"{info.file.name}: tensor {name!r} has shape {list(info.shape)}, but "
                        f"config.json describes {list(expected)}"
                    )
                plain = not (row.conv1d or row.transposed or row.depthwise)
                if len(slots) == 1 and plain and info.dtype == slots[0].dtype:
                    reader.read(name, out=slots[0])  # straight into the stacked buffer
                    continue
                tensor = reader.read(name)
            if row.conv1d and tensor.ndim == 2:
                tensor = tensor.T  # Conv1D (in, out) -> Linear (out, in)
            if row.transposed:
                tensor = np.swapaxes(tensor, -1, -2)  # (..., in, out) -> (..., out, in)
            if row.depthwise:
                tensor = tensor[:, 0]  # (channels, 1, kernel) -> (channels, kernel)
            if order is not None:  # interleaved per head -> the parts one after the other
                tensor = np.take(tensor, np.argsort(order), axis=row.axis)
            start = 0
            for slot in slots:  # split a fused tensor along its fused axis
                size = slot.shape[row.axis]
                slot[...] = axis_slice(tensor, row.axis, start, start + size)
                start += size
        for path, buffer in zip(row.eqllm, buffers, strict=True):
            arrays[path] = jax.device_put(buffer)  # adopts the aligned buffer on CPU
        del buffers
    if config.tie_embeddings:
        _check_tied_head(reader, arrays["embed.weight"], used)
    extra = sorted(n for n in set(reader.tensors) - used if not BUFFERS.match(n))
    family = families.get(config.family)
    skipped = [n for n in extra if family.ignored is not None and re.match(family.ignored, n)]
    if skipped:  # a vision tower, multi-token prediction: as transformers' class skips them
        log.warning(
            f"skipping {len(skipped)} tensors {family.architecture} does not use: {skipped[0]} ..."
        )
        extra = [n for n in extra if n not in skipped]
    beyond = [n for n in extra if _layer_of(n, prefix) >= config.n_layers]
    if beyond and family.skip_extra_layers:
        layers = sorted({_layer_of(n, prefix) for n in beyond})
        log.warning(
            "skipping %d tensors of layers %s past num_hidden_layers=%d (multi-token "
            "prediction, which eqllm does not use)",
            len(beyond),
            layers,
            config.n_layers,
        )
        extra = [n for n in extra if n not in beyond]
    if extra:
        shown = ", ".join(f"{n!r} ({reader.tensors[n].file.name})" for n in extra[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(
            f"the checkpoint has tensor(s) a {families.get(config.family).architecture} with this "
            f"config.json does not: {shown}{more}; config.json and weights disagree"
        )
    return jax.tree_util.tree_unflatten(treedef, [arrays[p] for p in leaves])


def _layer_of(name: str, prefix: str) -> int:
    """The layer number in a tensor name ("model.layers.61.mlp..." -> 61; -1 outside layers)."""
    match = re.match(rf"(?:{re.escape(prefix)})?layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def _check_tied_head(reader: TensorReader, embed: jax.Array, used: set[str]) -> None:
    """A tied model's checkpoint may still store the head; accept it only if it is the embed."""
    if TIED_HEAD not in reader:
        return
    used.add(TIED_HEAD)
    head = reader.read(TIED_HEAD)
    if head.shape != embed.shape or not np.array_equal(head.astype(embed.dtype), np.asarray(embed)):
        raise CheckpointError(
            f"{reader.tensors[TIED_HEAD].file.name}: tensor 'lm_head.weight' differs from the "
            "token embedding, but config.json ties them (tie_word_embeddings); set "
            "tie_word_embeddings to false in config.json to load the separate head"
        )
