"""GGUF for Gemma 4 (text), as llama.cpp's converter writes it (convert_hf_to_gguf.py's
`Gemma4Model`, a `Gemma3Model`), in the `gemma4` architecture of the gguf package (0.19 on).

The tensors are transformers' own, renamed by the gguf package's `TensorNameMap`. Gemma 4's norms
scale by w (not 1 + w), so none is shifted (the converter's `norm_shift` is 0). As the converter
renames them: each layer's `layer_scalar` is `blk.{i}.layer_output_scale.weight`, the router's
scale `blk.{i}.ffn_gate_inp.scale` and its scale per expert `blk.{i}.ffn_down_exps.scale`; the
experts stay fused as transformers 5 holds them (`ffn_gate_up_exps` [experts, 2 x d_ff, d_model],
gate rows first, and `ffn_down_exps`). llama.cpp turns the global layers' heads by frequency
factors: `rope_freqs` holds 1 for each turning frequency and 1e30 for the others (which then do
not turn), the converter's form of "proportional" RoPE; eqllm writes it for every model (all
ones where the global layers turn whole heads).

The metadata: the global layers' head size as `attention.key_length` and the local layers' as
`attention.key_length_swa` (and `rope.dimension_count` / `_swa`), both RoPE bases
(`rope.freq_base`, `rope.freq_base_swa`), the sliding layers (`attention.sliding_window_pattern`),
`attention.shared_kv_layers`, `embedding_length_per_layer_input`, `final_logit_softcapping`
where there is one, the experts' counts and size; per layer where the layers differ,
`attention.head_count_kv` (the global layers' kv heads) and `feed_forward_length` (the kv-shared
layers' double-wide MLP). The converter writes those two as arrays whenever config.json names
`num_global_key_value_heads` or `use_double_wide_mlp`; eqllm only where the layers differ, a
scalar telling llama.cpp the same (and transformers' GGUF loader reading scalars only). Keys
that are values (`attention_k_eq_v`) are global layers without `attn_v`, as llama.cpp reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from eqllm.hub.config import from_hf_config
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf_mamba import reader

ARCH = "gemma4"
SUFFIXES = (".weight", ".bias")
UNTURNED = 1e30  # the converter's frequency factor for a frequency that does not turn


def _names(gguf, n_layers: int):
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers)


def _target(gguf, names, name: str) -> tuple[Any, str]:
    """(gguf.MODEL_TENSOR, llama.cpp name) of the Hugging Face tensor `name`, renamed first as
    the converter's `filter_tensors` and `modify_tensors` rename it."""
    T = gguf.MODEL_TENSOR
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith(".router.scale"):
        return T.FFN_GATE_INP, gguf.TENSOR_NAMES[T.FFN_GATE_INP].format(bid=layer) + ".scale"
    if name.endswith(".router.per_expert_scale"):
        return T.FFN_DOWN_EXP, gguf.TENSOR_NAMES[T.FFN_DOWN_EXP].format(bid=layer) + ".scale"
    if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
        name += ".weight"
    found = names.get_type_and_name(name, try_suffixes=SUFFIXES)
    if found is None:
        raise CheckpointError(f"tensor {name!r} has no {ARCH} GGUF counterpart")
    return found


def rope_freqs(hf: dict) -> np.ndarray:
    """The global layers' frequency factors [global_head_dim / 2]: 1 for the turning quarter
    (or whole head), 1e30 for the rest, as the converter's `generate_extra_tensors` writes them."""
    full = hf["rope_parameters"]["full_attention"]
    proportional = full.get("rope_type") == "proportional"
    fraction = full.get("partial_rotary_factor", 1.0) if proportional else 1.0
    return rope_freqs_of(hf["global_head_dim"], int(hf["global_head_dim"] * fraction / 2))


def rope_freqs_of(head_dim: int, turning: int) -> np.ndarray:
    """1 for each of the first `turning` frequencies of a head of `head_dim`, 1e30 after."""
    return np.array([1.0] * turning + [UNTURNED] * (head_dim // 2 - turning), np.float32)


def write_gemma4(writer, gguf, hf: dict, tensors: dict, qtype, encode: Callable) -> None:
    """Metadata and tensors of a Gemma 4 model whose config.json is `hf` and Hugging Face
    tensors `tensors`, 2-D weights as `qtype` (`encode(array, qtype, gguf)` -> (data, raw
    dtype): `eqllm.hub.gguf._encode`)."""
    n, swa = hf["num_hidden_layers"], [t == "sliding_attention" for t in hf["layer_types"]]
    shared = hf.get("num_kv_shared_layers") or 0
    writer.add_block_count(n)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    ff = hf["intermediate_size"]
    wide = bool(hf.get("use_double_wide_mlp")) and shared > 0
    writer.add_feed_forward_length(
        [ff if i < n - shared else 2 * ff for i in range(n)] if wide else ff
    )
    writer.add_head_count(hf["num_attention_heads"])
    kv = hf["num_key_value_heads"]
    global_kv = (hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads")) or kv
    writer.add_head_count_kv(kv if global_kv == kv else [kv if s else global_kv for s in swa])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    head, global_head = hf["head_dim"], hf["global_head_dim"]
    writer.add_key_length(global_head)
    writer.add_value_length(global_head)
    writer.add_key_length_swa(head)
    writer.add_value_length_swa(head)
    rope = hf["rope_parameters"]
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    writer.add_rope_dimension_count(global_head)  # "proportional": by `rope_freqs`
    writer.add_rope_dimension_count_swa(head)
    if softcap := hf.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(softcap)
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hf.get("hidden_size_per_layer_input") or 0)
    if hf.get("enable_moe_block"):
        writer.add_expert_count(hf["num_experts"])
        writer.add_expert_used_count(hf["top_k_experts"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    T, names = gguf.MODEL_TENSOR, _names(gguf, n)
    F32 = gguf.GGMLQuantizationType.F32
    freqs = gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight"
    writer.add_tensor(freqs, rope_freqs(hf))  # a vector: F32
    for name, array in tensors.items():
        kind, target = _target(gguf, names, name)
        # Kept in F32 whatever the type, as the converter keeps them: vectors, norms, the router,
        # names without ".weight".
        f32 = kind == T.FFN_GATE_INP or not target.endswith(".weight")
        f32 = f32 or array.ndim < 2 or target.endswith("_norm.weight")
        data, raw = encode(array.astype(np.float32), F32 if f32 else qtype, gguf)
        writer.add_tensor(target, data, raw_dtype=raw)


# Reading ----------------------------------------------------------------------------------


def _per_layer(value: Any, n: int) -> list[int]:
    """A per-layer key as one int a layer (llama.cpp reads a scalar as the same for each)."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def _layer_sizes(get: Callable, n: int, swa: list[bool], shared: int, path) -> tuple:
    """(local kv heads, global kv heads, MLP size, whether it is double-wide) from llama.cpp's
    per-layer keys, which eqllm reads as one kv head count per layer type and one MLP size
    (twice it in the kv-shared layers: Gemma 4's double-wide MLP)."""
    kv = _per_layer(get("attention.head_count_kv"), n)
    ff = _per_layer(get("feed_forward_length"), n)
    first = {s: swa.index(s) for s in (True, False) if s in swa}  # a local and a global layer
    local_kv, global_kv = kv[first.get(True, 0)], kv[first.get(False, 0)]
    if any(kv[i] != (local_kv if s else global_kv) for i, s in enumerate(swa)) or (
        ff[: n - shared] != [ff[0]] * (n - shared)
        or ff[n - shared :] not in ([ff[0]] * shared, [2 * ff[0]] * shared)
    ):
        raise CheckpointError(
            f"{path}: {ARCH}.attention.head_count_kv={kv} or {ARCH}.feed_forward_length={ff}: "
            "eqllm reads one kv head count per layer type and one MLP size (twice it in the "
            "kv-shared layers)"
        )
    return local_kv, global_kv, ff[0], ff[-1] == 2 * ff[0] and shared > 0


def _config(field: Callable, stored: dict, path) -> dict[str, Any]:
    """config.json of a Gemma 4 file (KeyError naming a missing key)."""
    get = reader(field, ARCH)
    n = int(get("block_count"))
    swa = [bool(s) for s in get("attention.sliding_window_pattern")]
    shared = int(get("attention.shared_kv_layers", 0))
    local_kv, global_kv, d_ff, wide = _layer_sizes(get, n, swa, shared, path)
    head, global_head = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    rotated = (int(get("rope.dimension_count")), int(get("rope.dimension_count_swa")))
    if rotated != (global_head, head):
        raise CheckpointError(
            f"{path}: {ARCH}.rope.dimension_count(_swa) differ from the head sizes: eqllm reads "
            "Gemma 4 files whose heads turn whole, or by the global layers' rope_freqs"
        )
    freqs = stored.get("rope_freqs.weight")
    turning = global_head // 2 if freqs is None else int(np.sum(freqs == 1.0))
    if freqs is not None and not np.array_equal(freqs, rope_freqs_of(global_head, turning)):
        raise CheckpointError(
            f"{path}: rope_freqs holds factors other than 1 (turning) then 1e30 (still): eqllm "
            "reads Gemma 4's proportional RoPE only"
        )
    full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base"))}
    if turning != global_head // 2:
        full |= {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / global_head}
    # Global layers that keep keys (not kv-shared) but no values: their keys are their values.
    keyed = [i for i in range(n - shared) if not swa[i] and f"blk.{i}.attn_k.weight" in stored]
    k_eq_v = any(f"blk.{i}.attn_v.weight" not in stored for i in keyed)
    if global_kv != local_kv and not k_eq_v:
        raise CheckpointError(
            f"{path}: {ARCH}.attention.head_count_kv: Gemma 4's global layers have kv heads of "
            "their own only where their keys are their values (no attn_v)"
        )
    per_layer = int(get("embedding_length_per_layer_input", 0))
    table = stored.get("per_layer_token_embd.weight", stored["token_embd.weight"])
    softcap = field(f"{ARCH}.final_logit_softcapping")
    config = {
        "vocab_size": stored["token_embd.weight"].shape[0],
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": d_ff,
        "num_hidden_layers": n,
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": local_kv,
        "num_global_key_value_heads": global_kv,
        "attention_k_eq_v": k_eq_v,
        "head_dim": head,
        "global_head_dim": global_head,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in stored,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "final_logit_softcapping": None if softcap is None else get("final_logit_softcapping"),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": get("rope.freq_base_swa")},
        },
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": table.shape[0],
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": wide,
        "enable_moe_block": field(f"{ARCH}.expert_count") is not None,
    }
    if config["enable_moe_block"]:
        config |= {
            "num_experts": int(get("expert_count")),
            "top_k_experts": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
        }
    return config


def read_gemma4(gguf, field: Callable, stored: dict, path, hf_names: Callable) -> tuple:
    """(config.json, Hugging Face tensors) of a Gemma 4 file: the tensors the family's key table
    names for that config (`hf_names(config)`), each the llama.cpp tensor the converter renames
    it to."""
    if "token_embd.weight" not in stored:
        raise CheckpointError(f"{path}: the {ARCH} GGUF file has no token_embd.weight")
    try:
        config = {
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            **_config(field, stored, path),
        }
    except KeyError as e:
        raise CheckpointError(f"{path}: the {ARCH} GGUF file has no {e.args[0]} key") from None
    names = _names(gguf, config["num_hidden_layers"])
    tensors, used = {}, {"rope_freqs.weight"}
    for name in hf_names(from_hf_config(config)):
        target = _target(gguf, names, name)[1]
        if target not in stored:
            raise CheckpointError(f"{path}: the {ARCH} GGUF file has no {target}")
        tensors[name] = stored[target]
        used.add(target)
    if extra := sorted(set(stored) - used):
        raise CheckpointError(f"{path}: {ARCH} tensors eqllm does not read: {extra}")
    return config, tensors
