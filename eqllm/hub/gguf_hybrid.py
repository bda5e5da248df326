"""GGUF for the hybrid and state-space architectures, as llama.cpp's converter writes them.

llama.cpp's convert_hf_to_gguf.py (its `Qwen3NextModel`, `Qwen3_5TextModel`,
`Qwen3_5MoeTextModel`, `Mamba2Model`, `FalconH1Model`, `GraniteHybridModel` and
`NemotronHModel`) changes some tensors on the way; each
architecture here does the same, and undoes it when reading:

- Gated DeltaNet hybrids (qwen3next, qwen35, qwen35moe): A_log is stored as A = -exp(A_log),
  `dt_bias` as `dt_proj.bias`, the depthwise conv1d squeezed to [channels, kernel], every
  (1 + w) RMSNorm weight as 1 + w (the Gated DeltaNet's own output norm, which scales by w,
  stays); per-expert weights stacked into [experts, ...] tensors. Qwen3-Next's `in_proj_qkvz`
  (rows grouped by key head) is split into `attn_qkv` (all q rows, then k, then v) and
  `attn_gate` (z). Qwen3.5's value heads, grouped by key head in transformers' layout, are
  stored tiled ([v0 of every key head, v1 of every key head, ...]) wherever they appear.
- Mamba-2 (mamba2, falcon-h1): `eqllm.hub.gguf_mamba`.
- Mamba-2 hybrids with attention layers (nemotron_h, nemotron_h_moe, granitehybrid):
  `eqllm.hub.gguf_granite`.
- Attention alone: olmo2 (OLMo 2 and OLMo 3, `eqllm.hub.gguf_olmo`) and llama4 (its experts
  split and transposed, `eqllm.hub.gguf_llama4`).
- The DeepSeek-style mixtures of experts (glm4moe, deepseek2): `eqllm.hub.gguf_moe`.

Tensor names are the `gguf` package's (`gguf.TensorNameMap`), never a table of our own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from eqllm.hub.gguf_granite import (
    granite_config,
    granite_metadata,
    hybrid_from_gguf,
    hybrid_names,
    hybrid_to_gguf,
    nemotron_config,
    nemotron_metadata,
)
from eqllm.hub.gguf_llama4 import (
    llama4_config,
    llama4_from_gguf,
    llama4_metadata,
    llama4_names,
    llama4_to_gguf,
)
from eqllm.hub.gguf_mamba import (
    mamba_config,
    mamba_from_gguf,
    mamba_metadata,
    mamba_names,
    mamba_to_gguf,
    reader,
)
from eqllm.hub.gguf_moe import (
    deepseek_config,
    deepseek_metadata,
    glm_config,
    glm_metadata,
    moe_from_gguf,
    moe_names,
    moe_to_gguf,
)
from eqllm.hub.gguf_olmo import olmo_config, olmo_metadata

EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+\.weight)")
GDN = ("qwen3next", "qwen35", "qwen35moe")
# A family's architecture -> the one its models with experts are written as.
EXPERTS_ARCH = {"nemotron_h": "nemotron_h_moe"}
# Qwen3.5's multimodal rotary sections, written whatever the file says (llama.cpp's loader
# requires them); a text token has one position on every axis, where they are plain RoPE.
MROPE_SECTIONS = [11, 11, 10, 0]


@dataclass(frozen=True)
class Arch:
    """What one llama.cpp architecture needs beyond renaming.

    metadata(hf) -> {gguf key (without the "{arch}." prefix): value}; config(field, arch,
    tensor names) -> config.json fields; names(hf name, hf) -> the names the converter maps
    (after its renames); to_gguf(hf name, array, hf) -> [(name, array)]; from_gguf(hf name, arrays,
    hf) -> array.
    """

    metadata: Callable[[dict], dict[str, Any]]
    config: Callable[[Callable, str, set[str]], dict[str, Any]]
    names: Callable[[str, dict], list[str]]
    to_gguf: Callable[[str, np.ndarray, dict], list[tuple[str, np.ndarray]]]
    from_gguf: Callable[[str, list[np.ndarray], dict], np.ndarray]


# Gated DeltaNet hybrids -------------------------------------------------------------------


def _gdn_sizes(hf: dict) -> tuple[int, int, int, int]:
    return (
        hf["linear_num_key_heads"],
        hf["linear_num_value_heads"],
        hf["linear_key_head_dim"],
        hf["linear_value_head_dim"],
    )


def _tile(t: np.ndarray, axis: int, groups: int, per: int, dim: int, back: bool = False):
    """Value heads grouped by key head ([groups, per, dim] along `axis`) -> tiled ([per,
    groups, dim]); `back` undoes it."""
    shape = t.shape
    split = (per, groups, dim) if back else (groups, per, dim)
    t = t.reshape(*shape[:axis], *split, *shape[axis + 1 :])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def _qwen35_tiles(name: str, t: np.ndarray, hf: dict, back: bool) -> np.ndarray:
    """Qwen3.5's value-head order (`_LinearAttentionVReorderBase`) on one HF-named tensor."""
    nk, nv, dk, dv = _gdn_sizes(hf)
    if nk == nv or "linear_attn." not in name:
        return t
    r = nv // nk
    if ".in_proj_qkv." in name or ".conv1d." in name:
        qk = 2 * nk * dk
        return np.concatenate([t[:qk], _tile(t[qk:], 0, nk, r, dv, back)])
    if ".in_proj_z." in name:
        return _tile(t, 0, nk, r, dv, back)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return _tile(t, 0, nk, r, 1, back)
    if ".out_proj." in name:
        return _tile(t, 1, nk, r, dv, back)
    return t


def _offset_norm(name: str) -> bool:
    """The (1 + w) norms llama.cpp stores as 1 + w: all but the Gated DeltaNet's output norm."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def _gdn_names(name: str) -> list[str]:
    if name.endswith(".dt_bias"):
        return [name.removesuffix(".dt_bias") + ".dt_proj.bias"]
    if name.endswith(".in_proj_qkvz.weight"):
        stem = name.removesuffix("_qkvz.weight")
        return [stem + "_qkv.weight", stem + "_z.weight"]
    return [name]


def _gdn_to_gguf(arch: str):
    def to_gguf(name: str, t: np.ndarray, hf: dict) -> list[tuple[str, np.ndarray]]:
        if arch != "qwen3next":
            if ".conv1d." in name:
                t = t[:, 0]
            t = _qwen35_tiles(name, t, hf, back=False)
        if name.endswith(".A_log"):
            t = -np.exp(t)
        elif ".conv1d." in name:
            t = t.reshape(t.shape[0], -1)  # [channels, 1, kernel] -> [channels, kernel]
        elif _offset_norm(name):
            t = t + 1
        names = _gdn_names(name)
        if not name.endswith(".in_proj_qkvz.weight"):
            return [(names[0], t)]
        # [q, k, v, z] per key head -> all q, all k, all v; and z
        nk, nv, dk, dv = _gdn_sizes(hf)
        w = t.reshape(nk, -1, t.shape[-1])
        vz = nv // nk * dv
        q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + vz], axis=1)
        qkv = np.concatenate([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
        return [(names[0], qkv), (names[1], z.reshape(-1, t.shape[-1]))]

    return to_gguf


def _gdn_from_gguf(arch: str):
    def from_gguf(name: str, arrays: list[np.ndarray], hf: dict) -> np.ndarray:
        t = arrays[0]
        if name.endswith(".in_proj_qkvz.weight"):
            nk, nv, dk, dv = _gdn_sizes(hf)
            d = t.shape[-1]
            q, k, v = np.split(t, [nk * dk, 2 * nk * dk])
            parts = [p.reshape(nk, -1, d) for p in (q, k, v, arrays[1])]
            return np.concatenate(parts, axis=1).reshape(-1, d)
        if name.endswith(".A_log"):
            t = np.log(-t)
        elif _offset_norm(name):
            t = t - 1
        if arch != "qwen3next":
            t = _qwen35_tiles(name, t, hf, back=True)
        return t[:, None, :] if ".conv1d." in name else t

    return from_gguf


def _gdn_metadata(arch: str):
    def metadata(hf: dict) -> dict[str, Any]:
        nk, nv, dk, dv = _gdn_sizes(hf)
        rope = hf["rope_parameters"]
        types = hf["layer_types"]
        out = {
            "context_length": hf["max_position_embeddings"],
            "embedding_length": hf["hidden_size"],
            "block_count": hf["num_hidden_layers"],
            "attention.head_count": hf["num_attention_heads"],
            "attention.head_count_kv": hf["num_key_value_heads"],
            "attention.key_length": hf["head_dim"],
            "attention.value_length": hf["head_dim"],
            "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
            "rope.freq_base": float(rope["rope_theta"]),
            "rope.dimension_count": int(hf["head_dim"] * rope["partial_rotary_factor"]),
            "ssm.conv_kernel": hf["linear_conv_kernel_dim"],
            "ssm.state_size": dk,
            "ssm.group_count": nk,
            "ssm.time_step_rank": nv,
            "ssm.inner_size": dv * nv,
            "full_attention_interval": types.index("full_attention") + 1,
        }
        if "intermediate_size" in hf:
            out["feed_forward_length"] = hf["intermediate_size"]
        if "num_experts" in hf:
            out["expert_count"] = hf["num_experts"]
            out["expert_used_count"] = hf["num_experts_per_tok"]
            out["expert_feed_forward_length"] = hf["moe_intermediate_size"]
            out["expert_shared_feed_forward_length"] = hf["shared_expert_intermediate_size"]
        if arch != "qwen3next":
            out["rope.dimension_sections"] = MROPE_SECTIONS
        return out

    return metadata


def _gdn_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)

    # llama.cpp's Qwen3.5 files count the multi-token-prediction layers in block_count.
    n_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    every = int(get("full_attention_interval", 4))
    head_dim, nv = int(get("attention.key_length")), int(get("ssm.time_step_rank"))
    hf = {
        "num_hidden_layers": n_layers,
        "hidden_size": int(get("embedding_length")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(n_layers)
        ],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": nv,
        "linear_value_head_dim": int(get("ssm.inner_size")) // nv,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(get("rope.freq_base")),
            "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
        },
    }
    if field(f"{arch}.feed_forward_length") is not None:
        hf["intermediate_size"] = int(get("feed_forward_length"))
    if arch != "qwen35":
        hf |= {
            "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
        }
    if arch == "qwen3next":
        hf["norm_topk_prob"] = True
    return hf


ARCHS = {
    **{
        arch: Arch(
            _gdn_metadata(arch),
            _gdn_config,
            lambda name, hf: _gdn_names(name),
            _gdn_to_gguf(arch),
            _gdn_from_gguf(arch),
        )
        for arch in GDN
    },
    **{
        arch: Arch(
            mamba_metadata(arch),
            mamba_config,
            lambda name, hf: mamba_names(name),
            mamba_to_gguf(arch),
            mamba_from_gguf,
        )
        for arch in ("mamba2", "falcon-h1")
    },
    **{
        arch: Arch(
            nemotron_metadata,
            nemotron_config,
            hybrid_names,
            hybrid_to_gguf(arch),
            hybrid_from_gguf,
        )
        for arch in ("nemotron_h", "nemotron_h_moe")
    },
    "granitehybrid": Arch(
        granite_metadata,
        granite_config,
        hybrid_names,
        hybrid_to_gguf("granitehybrid"),
        hybrid_from_gguf,
    ),
    # Attention alone, renamed as the other architectures are: `eqllm.hub.gguf_olmo` (OLMo 2
    # and OLMo 3) and `eqllm.hub.gguf_llama4`.
    "olmo2": Arch(
        olmo_metadata,
        olmo_config,
        lambda name, hf: [name],
        lambda name, t, hf: [(name, t)],
        lambda name, arrays, hf: arrays[0],
    ),
    "llama4": Arch(llama4_metadata, llama4_config, llama4_names, llama4_to_gguf, llama4_from_gguf),
    "glm4moe": Arch(glm_metadata, glm_config, moe_names, moe_to_gguf, moe_from_gguf),
    "deepseek2": Arch(deepseek_metadata, deepseek_config, moe_names, moe_to_gguf, moe_from_gguf),
}


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors (`...experts.{j}.gate_proj.weight`) stacked into one
    `...experts.gate_proj.weight` [experts, ...] each, as the converter merges them."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
    for name, experts in groups.items():
        out[name] = np.stack([experts[j] for j in range(len(experts))])
    return out
