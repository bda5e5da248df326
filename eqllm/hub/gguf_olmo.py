"""GGUF for OLMo 2 and OLMo 3 as llama.cpp's olmo2 architecture, the one its converter
(convert_hf_to_gguf.py's `Olmo2Model`) writes both Olmo2ForCausalLM and Olmo3ForCausalLM as.

The tensors keep transformers' layout: llama.cpp rotates olmo2's heads by halves, as
transformers does, so the converter permutes no q/k rows; they are only renamed, by the gguf
package's table (`post_attention_layernorm` is `attn_post_norm`, `post_feedforward_layernorm`
`ffn_post_norm`). OLMo 3's windowed layers are metadata: `attention.sliding_window`,
`attention.sliding_window_pattern` (one bool per layer, True where the layer is windowed) and
the windowed layers' RoPE base, `rope.freq_base_swa`. A file with a window is read back as
OLMo 3, one without as OLMo 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eqllm.hub.gguf_mamba import reader

_PERIOD = 4  # llama.cpp's olmo2 window pattern where a file has a window and no pattern


def _rope(hf: dict) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) RoPE settings of a config.json, as the converter
    reads them: per layer type (OLMo 3, transformers 5) or one `rope_theta` (OLMo 2)."""
    params = hf.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    return {"rope_theta": hf.get("rope_theta"), **full}, params.get("sliding_attention") or {}


def olmo_metadata(hf: dict) -> dict[str, Any]:
    """The converter's keys (TextModel's and Olmo2Model's) from eqllm's config.json."""
    full, sliding = _rope(hf)
    out = {
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "block_count": hf["num_hidden_layers"],
        "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "rope.freq_base": float(full["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
    }
    if "rope_theta" in sliding:
        out["rope.freq_base_swa"] = float(sliding["rope_theta"])
    if "head_dim" in hf:
        out["attention.key_length"] = out["attention.value_length"] = hf["head_dim"]
    if "sliding_window" in hf:
        out["attention.sliding_window"] = hf["sliding_window"]
        out["attention.sliding_window_pattern"] = [
            kind == "sliding_attention" for kind in hf["layer_types"]
        ]
    return out


def olmo_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    """config.json of an olmo2 file: OLMo 3's (Olmo3ForCausalLM) where it has a window."""
    get = reader(field, arch)
    d, n = int(get("embedding_length")), int(get("block_count"))
    n_head = int(get("attention.head_count"))
    theta = float(get("rope.freq_base"))
    hf = {
        "hidden_size": d,
        "num_hidden_layers": n,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", d // n_head)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",
        "attention_bias": False,
    }
    window = field(f"{arch}.attention.sliding_window")
    if not window:
        return {**hf, "rope_theta": theta}
    pattern = field(f"{arch}.attention.sliding_window_pattern")
    if pattern is None or isinstance(pattern, int):  # a period: every period-th layer is full
        period = pattern or _PERIOD
        pattern = [(i + 1) % period != 0 for i in range(n)]
    return {
        **hf,
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in pattern],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(get("rope.freq_base_swa", theta)),
            },
        },
    }
