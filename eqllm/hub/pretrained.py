"""Load and save CausalLM weights: Hugging Face folders/repos and eqllm model folders.

Loading builds the model's shape skeleton without allocating (`eqx.filter_eval_shape`), then
fills one leaf at a time from the safetensors files, stacking layer tensors into the leading
`layers` axis; each filled buffer is handed to JAX (on CPU without a copy), so the peak host
memory is one copy of the weights plus one leaf. Saving writes one tensor at a time.
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
from jaxtyping import PRNGKeyArray

from eqllm import zoo
from eqllm.config import DType, ModelConfig
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub.config import ARCHITECTURES, from_hf_config, to_hf_config
from eqllm.hub.files import (
    CheckpointError,
    PlannedTensor,
    TensorReader,
    aligned_empty,
    parse_size,
    shard,
    write_file,
)
from eqllm.hub.tables import BUFFERS, PREFIX, TIED_HEAD, Row, rows_for
from eqllm.model import EXECUTION_FIELDS, CausalLM, dtype_of

log = logging.getLogger("eqllm.hub")

INDEX = "model.safetensors.index.json"
EQLLM_CONFIG = "eqllm_config.json"
# What a hub download fetches: the config, the weights and the tokenizer files.
_HUB_FILES = [
    "config.json",
    "*.safetensors",
    INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]
_EMBED_NAMES = {"gpt2": "wte.weight"} | dict.fromkeys(
    ("llama", "mistral", "qwen2", "gemma"), "embed_tokens.weight"
)
_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(dtype_of("bfloat16")): "bfloat16",
    np.dtype(np.float16): "float16",
}


# Locating checkpoints ------------------------------------------------------------------------


def resolve(
    path_or_repo_id: str | os.PathLike,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local folder for `path_or_repo_id`: the folder itself, or the hub snapshot of a repo."""
    spec = os.fspath(path_or_repo_id)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; give the folder that holds config.json")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise FileNotFoundError(
            f"{spec!r} is neither an existing folder nor a hub repo id of the form 'org/name'"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                spec,
                revision=revision,
                allow_patterns=_HUB_FILES,
                local_files_only=local_files_only,
            )
        )
    except Exception as e:
        offline = " (it is not in the local cache)" if local_files_only else ""
        raise FileNotFoundError(
            f"could not get the Hugging Face hub repo {spec!r}{offline}: {type(e).__name__}: {e}"
        ) from e


def _weight_files(folder: Path) -> list[Path]:
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
        return {k: v for k, v in cfg.to_dict().items() if k not in ignore}

    wanted = key(config)
    return next((name for name in zoo.names() if key(zoo.config(name)) == wanted), None)


# Hugging Face format -------------------------------------------------------------------------


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: DType | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
) -> CausalLM:
    """A CausalLM with the weights of a Hugging Face checkpoint (folder or hub repo id).

    Arguments:
        path_or_repo_id: a folder with config.json and *.safetensors (one file, or shards with
            model.safetensors.index.json), or a hub repo id, downloaded into the hub cache.
        dtype: parameter dtype ('float32', 'bfloat16', 'float16'); None keeps the checkpoint's.
            The compute dtype is set to the same (change it with `model.with_config`).
        revision, local_files_only: passed to `huggingface_hub.snapshot_download`.

    Raises CheckpointError naming the file and tensor for a missing, misshapen or unexpected
    tensor; ConfigError naming the field for an unsupported config.json.
    """
    folder = resolve(path_or_repo_id, revision=revision, local_files_only=local_files_only)
    hf = read_hf_config(folder)
    try:
        config = from_hf_config(hf)
    except ValueError as e:
        raise type(e)(f"{folder}: {e}") from None
    with TensorReader(_weight_files(folder)) as reader:
        if dtype is None:
            dtype = _checkpoint_dtype(reader, config.family)
        config = config.replace(param_dtype=dtype, compute_dtype=dtype)
        model = _load_hf_weights(config, reader)
    name = zoo_match(config)
    log.info(
        "loaded %s from %s%s",
        ARCHITECTURES[config.family],
        folder,
        f" (architecture of zoo variant {name})" if name else "",
    )
    return model


def _checkpoint_dtype(reader: TensorReader, family: str) -> DType:
    """The dtype of the token embedding (float32 if it is missing or not a float type)."""
    embed = next((n for n in reader.tensors if n.endswith(_EMBED_NAMES[family])), None)
    if embed is None:
        return "float32"
    return _DTYPE_NAMES.get(reader.tensors[embed].dtype, "float32")  # type: ignore[return-value]


def _skeleton(config: ModelConfig):
    """(leaf path -> ShapeDtypeStruct, treedef) of CausalLM(config), allocating nothing."""
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    paths = {jax.tree_util.keystr(p, simple=True, separator="."): leaf for p, leaf in flat}
    return paths, treedef


def _hf_shape(row: Row, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The HF tensor's shape for one layer, given the eqllm shapes (per layer) it holds."""
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    return shape[::-1] if row.conv1d else shape


def _load_hf_weights(config: ModelConfig, reader: TensorReader) -> CausalLM:
    leaves, treedef = _skeleton(config)
    rows = rows_for(config.family, set(leaves))
    prefix = PREFIX[config.family]
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

    arrays: dict[str, jax.Array] = {}
    for row in rows:
        targets = [leaves[p] for p in row.eqllm]
        buffers = [aligned_empty(t.shape, t.dtype) for t in targets]
        layer_shapes = [t.shape[1:] if row.layered else t.shape for t in targets]
        expected = _hf_shape(row, layer_shapes)
        for i in range(config.n_layers) if row.layered else [None]:
            name = find(row.hf.format(i=i))
            info = reader.tensors[name]
            if info.shape != expected:
                raise CheckpointError(
                    f"{info.file.name}: tensor {name!r} has shape {list(info.shape)}, but "
                    f"config.json describes {list(expected)}"
                )
            slots = [b if i is None else b[i] for b in buffers]
            if len(slots) == 1 and not row.conv1d and info.dtype == slots[0].dtype:
                reader.read(name, out=slots[0])  # straight into the stacked buffer
                continue
            tensor = reader.read(name)
            if row.conv1d and tensor.ndim == 2:
                tensor = tensor.T  # Conv1D (in, out) -> Linear (out, in)
            start = 0
            for slot in slots:  # split a fused tensor along its output axis
                slot[...] = tensor[start : start + slot.shape[0]]
                start += slot.shape[0]
        for path, buffer in zip(row.eqllm, buffers, strict=True):
            arrays[path] = jax.device_put(buffer)  # adopts the aligned buffer on CPU
        del buffers
    if config.tie_embeddings:
        _check_tied_head(reader, arrays["embed.weight"], used)
    extra = sorted(n for n in set(reader.tensors) - used if not BUFFERS.match(n))
    if extra:
        shown = ", ".join(f"{n!r} ({reader.tensors[n].file.name})" for n in extra[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(
            f"the checkpoint has tensor(s) a {ARCHITECTURES[config.family]} with this "
            f"config.json does not: {shown}{more}; config.json and weights disagree"
        )
    return jax.tree_util.tree_unflatten(treedef, [arrays[p] for p in leaves])


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
    beside them. `dtype` casts the weights (default: the model's parameter dtype).
    Returns the folder.
    """
    config = model.config
    dtype = dtype or config.param_dtype
    hf_config = to_hf_config(config)  # raises for configs transformers cannot express
    hf_config["torch_dtype"] = dtype
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = np.dtype(dtype_of(dtype))
    leaves, _ = _skeleton(config)
    rows = rows_for(config.family, set(leaves))
    host = _host_leaves(model)

    def make(row: Row, i: int | None):
        def tensor() -> np.ndarray:
            parts = [host[p] if i is None else host[p][i] for p in row.eqllm]
            out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            if row.conv1d and out.ndim == 2:
                out = out.T
            return np.ascontiguousarray(out, dtype=target)

        return tensor

    planned = []

    def plan(row: Row, i: int | None) -> None:
        shapes = [leaves[p].shape[1:] if row.layered else leaves[p].shape for p in row.eqllm]
        name = row.hf.format(i=i)
        planned.append(PlannedTensor(name, _hf_shape(row, shapes), target, make(row, i)))

    for i in range(config.n_layers):  # layer-major order, as transformers writes
        for row in rows:
            if row.layered:
                plan(row, i)
    for row in rows:
        if not row.layered:
            plan(row, None)
    _write_weights(folder, planned, parse_size(max_shard_size))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    return folder


def _host_leaves(model: CausalLM) -> dict[str, np.ndarray]:
    """Leaf path -> numpy array (a view of the JAX buffer on CPU; a host copy otherwise)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in flat
    }


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


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads too."""
    tokenizer.save(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer saved in `folder` (tokenizer.json + tokenizer_config.json), if any."""
    return Tokenizer.load(folder) if (folder / "tokenizer.json").is_file() else None


# eqllm model folders --------------------------------------------------------------------------


def save_model(
    model: CausalLM, directory: str | os.PathLike, *, tokenizer: Tokenizer | None = None
) -> Path:
    """Write an eqllm model folder: eqllm_config.json (ModelConfig) + model.safetensors.

    Tensors are the eqllm arrays as they are (layers stacked), named by their pytree path
    (e.g. 'blocks.attn.q_proj.weight'). Any config can be saved, exportable to HF or not.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    host = _host_leaves(model)
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
    leaves, treedef = _skeleton(config)
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
    _, treedef = _skeleton(config)
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
    try:
        folder = resolve(text, local_files_only=local_files_only)
    except FileNotFoundError as e:
        raise FileNotFoundError(
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
