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
loader share. A file is read back as the family whose Hugging Face model_type is llama.cpp's
architecture name.
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
from eqllm.data.sentencepiece import spm_bpe
from eqllm.data.tokenizer import Tokenizer
from eqllm.hub.files import CheckpointError

# llama.cpp's architectures whose q/k projection rows it stores in its own rotary order
# (convert_hf_to_gguf.py's LlamaModel permutes them; Qwen2's and Qwen3's keep transformers').
_PERMUTED_QK = frozenset({"llama"})
TYPES = ("f32", "f16", "bf16", "q8_0")
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


def _permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's LlamaModel.permute)."""
    n = n_kv if n_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    n = n_kv if n_kv != n_head else n_head
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Writing ----------------------------------------------------------------------------------


def _written() -> list[str]:
    """The families eqllm writes as GGUF files."""
    return [name for name in families.names() if families.get(name).gguf is not None]


def _model_types() -> dict[str, str]:
    """GGUF architecture -> the Hugging Face model_type a file of it is read back as: the
    family written under its own model_type's name."""
    found = (families.get(name) for name in families.names())
    return {f.gguf: f.model_type for f in found if f.gguf is not None and f.gguf == f.model_type}


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
            f"{settings}: GGUF architecture {family.gguf!r} cannot hold it, so this {cfg.family} "
            "model cannot be written as GGUF; convert it to a Hugging Face folder instead"
        )
    if (scaling := cfg.positions.scaling) is not None:
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
    arch = families.get(cfg.family).gguf
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(cfg.family)
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
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(
        {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[type]  # llama.cpp's LLAMA_FTYPE values
    )
    if tokenizer is not None:
        _write_tokenizer(writer, tokenizer)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    for name, array in tensors.items():
        array = array.astype(np.float32)
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            array = _permute(array, n_head, n_head)
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            array = _permute(array, n_head, n_kv)
        target, raw = _encode(array, qtype, gguf)
        writer.add_tensor(_rename(name, _NAMES), target, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(array: np.ndarray, qtype, gguf) -> tuple[np.ndarray, Any]:
    """(data, raw dtype) of one tensor: vectors stay F32, as llama.cpp keeps them; a Q8_0 row
    needs a length divisible by 32 (others fall back to F16, as llama.cpp's converter does)."""
    T = gguf.GGMLQuantizationType
    if array.ndim < 2 or qtype == T.F32:
        return array, None
    if qtype == T.F16 or (qtype == T.Q8_0 and array.shape[-1] % 32):
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def _write_tokenizer(writer, tokenizer: Tokenizer) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" vocabulary."""
    gguf = _package()

    data = json.loads(tokenizer.to_str())
    if data["model"]["type"] != "BPE" or (data.get("pre_tokenizer") or {}).get("type") not in (
        "ByteLevel",
        None,
    ):
        raise ConfigError(
            "eqllm writes byte-level BPE tokenizers (GPT-2 style) into GGUF files; convert with "
            "a tokenizer of that kind, or leave it out"
        )
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    types = [
        (gguf.TokenType.CONTROL if added[t].get("special") else gguf.TokenType.USER_DEFINED)
        if t in added
        else gguf.TokenType.NORMAL
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eot_id)
    bos = tokenizer.special_tokens.get("bos_token")
    if bos is not None and tokenizer.hf.token_to_id(bos) is not None:
        writer.add_bos_token_id(tokenizer.hf.token_to_id(bos))
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


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
    model_types = _model_types()
    if arch not in model_types:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; eqllm reads "
            f"{sorted(model_types)}"
        )
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    d = int(field(f"{arch}.embedding_length"))
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.rope.dimension_count")
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(t.shape)))
        if arch in _PERMUTED_QK and ".attn_q." in t.name:
            array = _unpermute(array, n_head, n_head)
        elif arch in _PERMUTED_QK and ".attn_k." in t.name:
            array = _unpermute(array, n_head, n_kv)
        tensors[_rename(t.name, _FROM_GGUF)] = np.ascontiguousarray(array)
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": [f"{arch.capitalize()}ForCausalLM"],
        "model_type": model_types[arch],
        "vocab_size": vocab,
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
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = _read_tokenizer(field, path)
    if tokenizer is not None:
        tokenizer.save(folder)
    return tokenizer


def _read_tokenizer(field, path) -> Tokenizer | None:
    """The vocabulary of a GGUF file: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    kind = field("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(field("tokenizer.ggml.tokens"))
    types = [int(t) for t in field("tokenizer.ggml.token_type", [1] * len(tokens))]
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        hf = tokenizers.Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        )
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_tokens(
            [
                AddedToken(t, special=k == 3, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k in (3, 4)
            ]
        )
    elif kind == "llama":
        unk = field("tokenizer.ggml.unknown_token_id")
        hf = spm_bpe(list(zip(tokens, types, strict=True)), unk_id=unk, byte_fallback=6 in types)
    else:
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported")
    specials = {}
    for role in ("bos", "eos", "unknown", "padding"):
        i = field(f"tokenizer.ggml.{role}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(role, role)
            specials[f"{key}_token"] = tokens[int(i)]
    if "eos_token" not in specials:
        raise CheckpointError(f"{path}: the GGUF tokenizer has no eos_token_id")
    return Tokenizer(
        hf,
        specials["eos_token"],
        "pretrained",
        chat_template=field("tokenizer.chat_template"),
        special_tokens=specials,
    )
