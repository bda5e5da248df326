"""GGUF for Llama 4's language model as llama.cpp's llama4 architecture (convert_hf_to_gguf.py's
`Llama4Model`).

The converter changes the experts only: transformers' fused `experts.gate_up_proj`
[experts, d_model, 2 d_ff] (x @ W, gate columns then up) becomes `ffn_gate_exps` and
`ffn_up_exps` [experts, d_ff, d_model] each, and `experts.down_proj` [experts, d_ff, d_model]
becomes `ffn_down_exps` [experts, d_model, d_ff]; q/k rows keep transformers' order (Llama 4
rotates adjacent pairs, as llama.cpp's llama4 does). The router (`ffn_gate_inp`) stays F32, the
shared expert is `ffn_{gate,up,down}_shexp`, the dense layers between expert layers (Maverick)
`ffn_{gate,up,down}` of `feed_forward_length` (`intermediate_size_mlp`); the experts' width is
`expert_feed_forward_length` and their period `interleave_moe_layer_step`.

What the file does not hold, llama.cpp fixes (src/models/llama4.cpp): chunks of 8192 positions
on three of every four layers, every fourth layer global without RoPE, temperature tuning with
floor 8192 and scale 0.1, and L2-normalised queries and keys unless the model has 128 experts
(Maverick), as `eqllm.families.llama4.GGUF_FIXED` lists them. A model with other settings is
refused (`eqllm.families.llama4.gguf_refuses`); a file is read back with these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from eqllm.families.llama4 import GGUF_FIXED, GGUF_UNNORMED_EXPERTS
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf_mamba import reader

PERIOD = GGUF_FIXED["attention.global_every"]  # chunked, chunked, chunked, global NoPE


def llama4_metadata(hf: dict) -> dict[str, Any]:
    """The converter's keys (TextModel's, LlamaModel's and Llama4Model's) from eqllm's
    config.json."""
    return {
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "block_count": hf["num_hidden_layers"],
        "feed_forward_length": hf["intermediate_size_mlp"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "rope.freq_base": float(hf["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
        "expert_count": hf["num_local_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "attention.key_length": hf["head_dim"],
        "attention.value_length": hf["head_dim"],
        "rope.dimension_count": hf["head_dim"],
        "interleave_moe_layer_step": hf["interleave_moe_layer_step"],
        "expert_feed_forward_length": hf["intermediate_size"],
    }


def llama4_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    """config.json of a llama4 file, with llama.cpp's fixed settings."""
    get = reader(field, arch)
    if field(f"{arch}.attention.sliding_window") == 0:
        raise CheckpointError(
            f"{arch}.attention.sliding_window=0 (no chunked layers) is not supported; eqllm reads "
            "llama4 files with llama.cpp's chunked attention"
        )
    n = int(get("block_count"))
    stored = field(f"{arch}.attention.sliding_window_pattern", PERIOD)
    # A period (every period-th layer global) or one bool per layer (True: chunked).
    pattern = [(i + 1) % stored != 0 for i in range(n)] if isinstance(stored, int) else stored
    if list(pattern) != [(i + 1) % PERIOD != 0 for i in range(n)]:
        raise CheckpointError(
            f"{arch}.attention.sliding_window_pattern={stored} is not supported; eqllm's llama4 "
            f"chunks exactly its rotary layers, every {PERIOD}th layer global (llama.cpp's NoPE "
            "period)"
        )
    n_head, n_experts = int(get("attention.head_count")), int(get("expert_count"))
    d = int(get("embedding_length"))
    return {
        "hidden_size": d,
        "num_hidden_layers": n,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", d // n_head)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "intermediate_size": int(get("expert_feed_forward_length")),
        "intermediate_size_mlp": int(get("feed_forward_length")),
        "num_local_experts": n_experts,
        "num_experts_per_tok": int(get("expert_used_count", 1)),
        "interleave_moe_layer_step": int(get("interleave_moe_layer_step", 1)),
        "use_qk_norm": n_experts != GGUF_UNNORMED_EXPERTS,
        "no_rope_layer_interval": GGUF_FIXED["positions.nope_every"],
        "attention_chunk_size": GGUF_FIXED["attention.chunk_size"],
        "attn_temperature_tuning": True,
        "floor_scale": GGUF_FIXED["attention.temperature_floor"],
        "attn_scale": GGUF_FIXED["attention.temperature_scale"],
    }


def llama4_names(name: str, hf: dict) -> list[str]:
    """The names the converter maps a Hugging Face tensor to (after its split and renames)."""
    if name.endswith(".experts.gate_up_proj"):
        stem = name.removesuffix("gate_up_proj")
        return [stem + "gate_proj.weight", stem + "up_proj.weight"]
    if name.endswith(".experts.down_proj"):
        return [name + ".weight"]
    return [name]


def llama4_to_gguf(name: str, t: np.ndarray, hf: dict) -> list[tuple[str, np.ndarray]]:
    names = llama4_names(name, hf)
    if name.endswith(".experts.gate_up_proj"):  # [E, d, 2 ff] -> [E, 2 ff, d]: gate rows, up rows
        return list(zip(names, np.split(np.swapaxes(t, -1, -2), 2, axis=-2), strict=True))
    if name.endswith(".experts.down_proj"):  # [E, ff, d] -> [E, d, ff]
        return [(names[0], np.swapaxes(t, -1, -2))]
    return [(name, t)]


def llama4_from_gguf(name: str, arrays: list[np.ndarray], hf: dict) -> np.ndarray:
    if name.endswith(".experts.gate_up_proj"):
        return np.swapaxes(np.concatenate(arrays, axis=-2), -1, -2)
    if name.endswith(".experts.down_proj"):
        return np.swapaxes(arrays[0], -1, -2)
    return arrays[0]
