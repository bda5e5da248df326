"""GGUF files (llama.cpp, ollama) both ways, with the `gguf` package llama.cpp maintains.

Both directions go through a Hugging Face folder, so the families' key tables and config
translation stay the one source of truth:

- `eqllm.hub.save_gguf` writes the model as `save_pretrained` does, then `folder_to_gguf`
  renames the tensors to llama.cpp's (`blk.{i}.attn_q.weight`, ...), permutes the Llama q/k rows
  into llama.cpp's rotary layout (as its convert_hf_to_gguf.py does), writes the architecture
  metadata, the tokenizer (byte-level BPE: tokens, types, merges) and the chat template, and
  stores 2-D weights as F32, F16, BF16 or Q8_0 (vectors stay F32, as llama.cpp keeps them).
- `gguf_to_folder` (behind `eqllm.hub.from_pretrained("model.gguf")`) dequantizes every tensor
  (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other types the package reads) to
  float32, undoes the permutation, rebuilds config.json and the tokenizer (BPE "gpt2" or
  SentencePiece "llama" vocabularies) for the ordinary loader.

Architectures: each family names the one it is written as (`eqllm.families.Family.gguf`, and
what that architecture cannot hold, `gguf_refuses`): llama (eqllm's llama and, without a sliding
window, mistral), qwen2 and qwen3, the Llama-layout families llama.cpp and transformers' GGUF
loader share; and qwen35, qwen35moe, qwen3next, mamba2, falcon-h1, nemotron_h (with experts
nemotron_h_moe, `EXPERTS_ARCH`), granitehybrid, olmo2 (OLMo 2 and OLMo 3) and llama4
(`eqllm.hub.gguf_hybrid`), glm4moe and deepseek2 (`eqllm.hub.gguf_moe`), their tensors renamed
by the gguf package's own `TensorNameMap` and changed as llama.cpp's converter changes them; and
gemma4 (`eqllm.hub.gguf_gemma4`), Gemma 4's text model as the converter writes it. A file is
read back as the family whose Hugging Face model_type is llama.cpp's architecture name (an olmo2
file with a sliding window as olmo3), else the one family written as it (deepseek2: as its
metadata says, `eqllm.hub.gguf_moe`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from eqllm import families
from eqllm.config import ConfigError
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub.config import from_hf_config
from eqllm.hub.files import CheckpointError
from eqllm.hub.folders import skeleton
from eqllm.hub.gguf_gemma4 import ARCH as GEMMA4
from eqllm.hub.gguf_gemma4 import read_gemma4, write_gemma4
from eqllm.hub.gguf_granite import permute
from eqllm.hub.gguf_hybrid import ARCHS, EXPERT, EXPERTS_ARCH, stack_experts
from eqllm.hub.gguf_moe import READ_AS, SCALED
from eqllm.hub.gguf_vocab import read_tokenizer, write_tokenizer
from eqllm.hub.tables import indices, part_names, rows_for, stack_layers, tensor_name

# llama.cpp's architectures whose q/k projection rows it stores in its own rotary order
# (convert_hf_to_gguf.py's LlamaModel permutes them; Qwen2's and Qwen3's keep transformers').
_PERMUTED_QK = frozenset({"llama"})
TYPES = ("f32", "f16", "bf16", "q8_0")
SUFFIXES = (".weight", ".bias")
_NAMES = [  # Hugging Face tensor name -> llama.cpp's
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"blk.\1.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"blk.\1.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
]


def _rename(name: str, table: list[tuple[str, str]]) -> str:
    for pattern, replacement in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise CheckpointError(f"tensor {name!r} has no GGUF counterpart")


def _reverse(hf: str, gguf: str) -> tuple[str, str]:
    """(pattern of the GGUF name, replacement giving the Hugging Face name) of a `_NAMES` row."""
    pattern = re.escape(gguf).replace(r"\\1", r"(\d+)").replace(r"\\2", r"(weight|bias)")
    groups = iter((r"\1", r"\2"))
    name = re.sub(r"\(\\d\+\)|\(weight\|bias\)", lambda m: next(groups), hf)
    return pattern, name.replace("\\.", ".")


_FROM_GGUF = [_reverse(hf, g) for hf, g in _NAMES]


def _package():
    """The `gguf` package (an optional dependency: `pip install eqllm[gguf]`)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(
            "reading or writing GGUF files needs the gguf package: pip install 'eqllm[gguf]'"
        ) from None
    return gguf


# Writing ----------------------------------------------------------------------------------


def _written() -> list[str]:
    """The families eqllm writes as GGUF files."""
    return [name for name in families.names() if families.get(name).gguf is not None]


def gguf_arch(cfg) -> str | None:
    """The GGUF architecture a model of config `cfg` is written as: its family's, or with
    experts the family's expert architecture (`EXPERTS_ARCH`) where llama.cpp has one."""
    arch = families.get(cfg.family).gguf
    return EXPERTS_ARCH.get(arch, arch) if cfg.moe is not None else arch


def _family_of(arch: str):
    """The family a file of GGUF architecture `arch` is read back as: the one written under its
    own model_type's name (or `READ_AS`), else the only one written as `arch`; None if none."""
    found = [f for f in families.every() if arch in (f.gguf, EXPERTS_ARCH.get(f.gguf or ""))]
    own = [f for f in found if f.model_type == arch or f.name == READ_AS.get(arch)]
    return (own or found)[0] if len(own or found) == 1 else None


def check_exportable(cfg, type: str) -> None:
    """Raise unless a model of config `cfg` can be written as a GGUF file of `type`."""
    if type not in TYPES:
        raise ConfigError(f"GGUF --type {type!r} is not supported; use one of {list(TYPES)}")
    family = families.get(cfg.family)
    if family.gguf is None:
        raise ConfigError(
            f"a {cfg.family} model has no GGUF architecture eqllm writes (families "
            f"{', '.join(_written())}); convert it to a Hugging Face folder instead"
        )
    wrong = family.gguf_refuses(cfg)
    if wrong:
        settings = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        raise ConfigError(
            f"{settings}: GGUF architecture {gguf_arch(cfg)!r} cannot hold it, so this "
            f"{cfg.family} model cannot be written as GGUF; convert it to a Hugging Face folder "
            "instead"
        )
    if (scaling := cfg.positions.scaling) is not None and gguf_arch(cfg) not in SCALED:
        raise ConfigError(
            f"positions.scaling.kind={scaling.kind!r}: eqllm writes GGUF files with plain rotary "
            "positions only (llama.cpp keeps the scaled frequencies as a tensor)"
        )


def folder_to_gguf(folder: Path, path: Path, cfg, tokenizer: Tokenizer | None, type: str) -> Path:
    """Write the Hugging Face folder `folder` (float32 weights of a model of config `cfg`, as
    `save_pretrained` wrote it) as the GGUF file `path`."""
    gguf = _package()
    check_exportable(cfg, type)
    from safetensors.numpy import load_file

    hf = json.loads((folder / "config.json").read_text())
    arch = gguf_arch(cfg)
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(cfg.family)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(
        {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[type]  # llama.cpp's LLAMA_FTYPE values
    )
    if tokenizer is not None:
        write_tokenizer(writer, gguf, tokenizer)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if arch == GEMMA4:
        write_gemma4(writer, gguf, hf, tensors, qtype, _encode)
    elif arch in ARCHS:
        _write_hybrid(writer, gguf, arch, hf, tensors, qtype)
    else:
        _write_llama(writer, gguf, arch, cfg, hf, tensors, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_llama(writer, gguf, arch: str, cfg, hf: dict, tensors: dict, qtype) -> None:
    """The Llama-layout architectures (llama, qwen2, qwen3): metadata and tensors."""
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.mlp.d_ff)
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_dimension_count(hf["head_dim"])
    writer.add_rope_freq_base(float(hf["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    for name, array in tensors.items():
        array = array.astype(np.float32)
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            array = permute(array, n_head, n_head)
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            array = permute(array, n_head, n_kv)
        target, raw = _encode(array, qtype, gguf)
        writer.add_tensor(_rename(name, _NAMES), target, raw_dtype=raw)


def _name_map(gguf, arch: str, n_layers: int):
    """The gguf package's Hugging Face -> llama.cpp tensor names of `arch`."""
    enum = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    return gguf.get_tensor_name_map(enum, n_layers)


def _write_hybrid(writer, gguf, arch: str, hf: dict, tensors: dict, qtype) -> None:
    """The hybrid and state-space architectures (`eqllm.hub.gguf_hybrid`)."""
    spec, T = ARCHS[arch], gguf.MODEL_TENSOR
    metadata = spec.metadata(hf)
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    names = _name_map(gguf, arch, metadata["block_count"])
    # Kept in F32 whatever the type, as the converter keeps them.
    f32 = {T.FFN_GATE_INP, T.FFN_GATE_INP_SHEXP, T.SSM_CONV1D}
    for name, array in stack_experts(tensors).items():
        for mapped, out in spec.to_gguf(name, array.astype(np.float32), hf):
            found = names.get_type_and_name(mapped, try_suffixes=SUFFIXES)
            if found is None:
                raise CheckpointError(f"tensor {name!r} has no {arch} GGUF counterpart")
            kind, target = found
            keep = kind in f32 or not target.endswith(".weight") or target.endswith("_norm.weight")
            data, raw = _encode(out, gguf.GGMLQuantizationType.F32 if keep else qtype, gguf)
            writer.add_tensor(target, data, raw_dtype=raw)


def _encode(array: np.ndarray, qtype, gguf) -> tuple[np.ndarray, Any]:
    """(data, raw dtype) of one tensor: vectors stay F32, as llama.cpp keeps them; a Q8_0 row
    needs a length divisible by 32 (others fall back to F16, as llama.cpp's converter does)."""
    T = gguf.GGMLQuantizationType
    if array.ndim < 2 or qtype == T.F32:
        return array, None
    if qtype == T.F16 or (qtype == T.Q8_0 and array.shape[-1] % 32):
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


# Reading ----------------------------------------------------------------------------------


def is_gguf(path: str | os.PathLike) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def gguf_to_folder(path: str | os.PathLike, folder: str | os.PathLike) -> Tokenizer | None:
    """Write a GGUF file's model as a Hugging Face folder (config.json, model.safetensors);
    returns its tokenizer (None when the file has none), saved there too."""
    from safetensors.numpy import save_file

    gguf = _package()

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    family = _family_of(arch)
    if family is None:
        known = {f.gguf for f in families.every() if _family_of(f.gguf or "")}
        known = sorted(known | {EXPERTS_ARCH[a] for a in known & set(EXPERTS_ARCH)})
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; eqllm reads {known}"
        )
    stored: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        stored[t.name] = array.reshape(tuple(int(n) for n in reversed(t.shape)))
    if arch == GEMMA4:
        config, tensors = read_gemma4(gguf, field, stored, path, hf_tensor_names)
    elif arch in ARCHS:
        config, tensors = _read_hybrid(gguf, arch, family, field, stored, path)
    else:
        config, tensors = _read_llama(arch, family, field, stored)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = read_tokenizer(field, path)
    if tokenizer is not None:
        tokenizer.save(folder)
    return tokenizer


def _read_llama(arch: str, family, field, stored: dict) -> tuple[dict, dict]:
    """config.json and Hugging Face tensors of a Llama-layout file (llama, qwen2, qwen3)."""
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    d = int(field(f"{arch}.embedding_length"))
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.rope.dimension_count")
    tensors: dict[str, np.ndarray] = {}
    for name, array in stored.items():
        if arch in _PERMUTED_QK and ".attn_q." in name:
            array = permute(array, n_head, n_head, back=True)
        elif arch in _PERMUTED_QK and ".attn_k." in name:
            array = permute(array, n_head, n_kv, back=True)
        tensors[_rename(name, _FROM_GGUF)] = array
    config = {
        "architectures": [f"{arch.capitalize()}ForCausalLM"],
        "model_type": family.model_type,
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": d,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(head_dim or d // n_head),
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    return config, tensors


def hf_tensor_names(config) -> list[str]:
    """The Hugging Face tensor names `save_pretrained` writes for a model of `config`."""
    leaves, _ = skeleton(config)
    names = []
    for row in rows_for(config.family, set(leaves)):
        spans = stack_layers(row, config)
        for index in indices(row, len(spans), config.at("moe.n_experts")):
            names += part_names(row, tensor_name(row, index, spans))
    return names


def _read_hybrid(gguf, arch: str, family, field, stored: dict, path) -> tuple[dict, dict]:
    """config.json and Hugging Face tensors of a hybrid or state-space file: the tensors the
    family's key table names for that config, each from the llama.cpp tensors the gguf
    package maps its name to, the converter's transforms undone (`eqllm.hub.gguf_hybrid`)."""
    spec = ARCHS[arch]
    if "token_embd.weight" not in stored:
        raise CheckpointError(f"{path}: the {arch} GGUF file has no token_embd.weight")
    try:
        config = {
            "architectures": [family.architecture],
            "model_type": family.model_type,
            "vocab_size": stored["token_embd.weight"].shape[0],
            "tie_word_embeddings": "output.weight" not in stored,
            **spec.config(field, arch, set(stored)),
        }
    except KeyError as e:
        raise CheckpointError(f"{path}: the {arch} GGUF file has no {e.args[0]} key") from None
    n_layers = config["num_hidden_layers"]
    names = _name_map(gguf, arch, n_layers)
    tensors, done, used = {}, {}, set()
    for name in hf_tensor_names(from_hf_config(config)):
        m = EXPERT.fullmatch(name)
        whole = f"{m[1]}.{m[3]}" if m else name  # an expert's slice of its stacked tensor
        if whole not in done:
            targets = [names.get_name(n, try_suffixes=SUFFIXES) for n in spec.names(whole, config)]
            missing = [t for t in targets if t not in stored]
            if missing:
                raise CheckpointError(f"{path}: the {arch} GGUF file has no {missing[0]}")
            used.update(targets)
            done[whole] = spec.from_gguf(whole, [stored[t] for t in targets], config)
        tensors[name] = done[whole][int(m[2])] if m else done[whole]
    # Layers past the model's: llama.cpp's multi-token-prediction layers, left out as on import.
    beyond = [n for n in stored if (m := re.match(r"blk\.(\d+)\.", n)) and int(m[1]) >= n_layers]
    if extra := sorted(set(stored) - used - set(beyond)):
        raise CheckpointError(f"{path}: {arch} tensors eqllm does not read: {extra}")
    return config, tensors
