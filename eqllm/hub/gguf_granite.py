"""GGUF for Nemotron-H and Granite 4.0-H, as llama.cpp's converter writes them
(`GraniteHybridModel`, and `NemotronHModel`, which derives from it).

Both stack Mamba-2 layers with attention layers (and, in Nemotron-H, MLP layers of their own).
llama.cpp tells a layer's kind from per-layer metadata: `attention.head_count_kv` is 0 but for
an attention layer, and Nemotron-H's `feed_forward_length` 0 but for an MLP layer. The tensors:

- Mamba-2 layers as `eqllm.hub.gguf_mamba` writes them (A as -exp(A_log), D as [heads, 1],
  the conv1d squeezed, the gated norm as [groups, inner / groups], `dt_bias` as `ssm_dt.bias`);
- attention q/k rows in llama.cpp's rotary order (`permute`), as the converter's LlamaModel
  writes them for both: Nemotron-H's attention has no rotary, where the one permutation of q
  and k leaves the scores as they are;
- Granite's fused `input_linear` split in halves, gate then up: the shared MLP's as
  `ffn_{gate,up}_shexp` (`ffn_{gate,up}` in the dense sizes, whose `output_linear` is then
  `ffn_down`), the experts' as `ffn_{gate,up}_exps`.

Nemotron-H with experts (Nemotron 3) is the converter's other architecture, `nemotron_h_moe`:
its "E" layers are the MLP layers of the metadata (`feed_forward_length` the experts' size),
the experts stacked into `ffn_{up,down}_exps` [experts, ...], the router `ffn_gate_inp`, the
correction bias `exp_probs_b.bias`, the shared expert `ffn_{up,down}_shexp`, the routing in
the `expert_*` keys.

Granite's four multipliers are `embedding_scale`, `residual_scale`, `attention.scale` and
`logit_scale` (llama.cpp divides the logits by it, as transformers does), none folded into a
weight; `rope.scaling.finetuned` is llama.cpp's switch for Granite's rotary positions. The
converter sets it by architecture (off for every GraniteMoeHybrid with Mamba-2 layers), eqllm by
`position_embedding_type`; they agree on the published models, which use none.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from eqllm.families import granitemoehybrid, nemotron_h
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf_mamba import mamba_from_gguf, mamba_names, mamba_sizes, mamba_to_gguf, reader

LAYER = re.compile(r"(?:backbone|model)\.layers\.(\d+)\.")
SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid scores
QK = (("q_proj.weight", "q_proj.bias"), ("k_proj.weight", "k_proj.bias"))


def permute(w: np.ndarray, n_head: int, n_kv: int, back: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's LlamaModel.permute): per head, the
    rows of transformers' first and second halves interleaved (r0, r_half, r1, r_half+1, ...),
    the pairs llama.cpp's rotary turns together; `back` undoes it."""
    n = n_kv if n_kv != n_head else n_head
    split = (n, w.shape[0] // n // 2, 2) if back else (n, 2, w.shape[0] // n // 2)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_qk(name: str, t: np.ndarray, hf: dict, back: bool) -> np.ndarray:
    n_head = hf["num_attention_heads"]
    if name.endswith(QK[0]):
        return permute(t, n_head, n_head, back)
    if name.endswith(QK[1]):
        return permute(t, n_head, hf["num_key_value_heads"], back)
    return t


def hybrid_names(name: str, hf: dict) -> list[str]:
    """The names the gguf package maps to the halves of a Granite `input_linear` (or, for a
    dense model's shared `output_linear`, to `ffn_down`); [name] for any other tensor."""
    m = LAYER.match(name)
    mlp = f"model.layers.{m[1]}.mlp." if m else ""
    experts = hf.get("num_local_experts", 0) > 0
    if re.search(r"\.mixer\.experts\.(up|down)_proj\.weight$", name):  # Nemotron 3, stacked
        return [mlp + name[name.index("experts.") :]]
    if name.endswith(".gate.e_score_correction_bias"):
        return [name.removesuffix("_bias") + ".bias"]
    if name.endswith("block_sparse_moe.input_linear.weight"):
        return [f"{mlp}experts.gate_proj.weight", f"{mlp}experts.up_proj.weight"]
    if name.endswith("shared_mlp.input_linear.weight"):
        part = "shared_expert." if experts else ""
        return [f"{mlp}{part}gate_proj.weight", f"{mlp}{part}up_proj.weight"]
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        return [f"{mlp}down_proj.weight"]
    return mamba_names(name)


def hybrid_to_gguf(arch: str):
    mamba = mamba_to_gguf(arch)

    def to_gguf(name: str, t: np.ndarray, hf: dict) -> list[tuple[str, np.ndarray]]:
        names = hybrid_names(name, hf)
        if len(names) == 2:  # gate rows, then up rows
            return list(zip(names, np.split(t, 2, axis=-2), strict=True))
        if names[0] != mamba_names(name)[0]:
            return [(names[0], t)]
        return mamba(name, _permute_qk(name, t, hf, back=False), hf)

    return to_gguf


def hybrid_from_gguf(name: str, arrays: list[np.ndarray], hf: dict) -> np.ndarray:
    if len(arrays) == 2:
        return np.concatenate(arrays, axis=-2)
    return _permute_qk(name, mamba_from_gguf(name, arrays, hf), hf, back=True)


def _ssm_metadata(hf: dict, conv_kernel: int) -> dict[str, Any]:
    inner, heads, groups, state = mamba_sizes(hf)
    return {
        "ssm.conv_kernel": conv_kernel,
        "ssm.inner_size": inner,
        "ssm.state_size": state,
        "ssm.time_step_rank": heads,
        "ssm.group_count": groups,
    }


def _ssm_config(get: Callable, d: int) -> dict[str, Any]:
    """The file's Mamba-2 sizes: inner, heads, head_dim, groups, state and kernel."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return {
        "inner": inner,
        "heads": heads,
        "head_dim": inner // heads,
        "groups": int(get("ssm.group_count")),
        "state": int(get("ssm.state_size")),
        "kernel": int(get("ssm.conv_kernel")),
    }


def _per_layer(value: Any, n: int) -> list[int]:
    """A per-layer key as llama.cpp reads it: an array, or one number for every layer."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


# Nemotron-H ---------------------------------------------------------------------------------


def nemotron_metadata(hf: dict) -> dict[str, Any]:
    kinds = nemotron_h.pattern_from_hf(hf)
    head_dim = hf["head_dim"]
    experts = "moe" in hf["layers_block_type"]
    ff = hf["moe_intermediate_size"] if experts else hf["intermediate_size"]
    return {
        # The converter writes 2**20 (no rotary positions); the model's own is kept.
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "block_count": len(kinds),
        "feed_forward_length": [ff if k == "ffn" else 0 for k in kinds],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": [hf["num_key_value_heads"] if k == "full" else 0 for k in kinds],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(hf["layer_norm_epsilon"]),
        "rope.scaling.finetuned": False,
        **_ssm_metadata(hf, hf["conv_kernel"]),
        **(_nemotron_experts(hf) if experts else {}),
    }


def _nemotron_experts(hf: dict) -> dict[str, Any]:
    """The converter's `expert_*` keys of a Nemotron-H with experts, and the two it leaves out:
    the groups chosen (`expert_group_used_count`) and the sigmoid scoring (gating func 2)."""
    return {
        "expert_count": hf["n_routed_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_shared_count": hf["n_shared_experts"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
        "expert_shared_feed_forward_length": hf["moe_shared_expert_intermediate_size"],
        "expert_weights_norm": bool(hf["norm_topk_prob"]),
        "expert_weights_scale": float(hf["routed_scaling_factor"]),
        "expert_group_count": hf["n_group"],
        "expert_group_used_count": hf["topk_group"],
        "expert_gating_func": SIGMOID,
    }


def nemotron_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)
    d, n = int(get("embedding_length")), int(get("block_count"))
    kv = _per_layer(get("attention.head_count_kv"), n)
    ff = _per_layer(get("feed_forward_length", 0), n)
    kinds = ["full" if h else "ffn" if f else "linear" for h, f in zip(kv, ff, strict=True)]
    experts = arch == "nemotron_h_moe"
    names = {**nemotron_h.HF_NAMES, "ffn": "moe"} if experts else nemotron_h.HF_NAMES
    sizes = {f for f in ff if f}
    if len(sizes) > 1:
        raise CheckpointError(
            f"the {arch} GGUF file's MLP layers have feed_forward_length {sorted(sizes)}; eqllm's "
            "nemotron_h gives every MLP layer one size"
        )
    n_head = max(_per_layer(get("attention.head_count"), n))
    ssm = _ssm_config(get, d)
    hf = {
        "hidden_size": d,
        "num_hidden_layers": n,
        "layers_block_type": [names[k] for k in kinds],
        "num_attention_heads": n_head,
        "num_key_value_heads": max(kv) or n_head,
        "head_dim": int(get("attention.key_length", d // n_head)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon")),
        "mlp_bias": any(t.endswith("ffn_up.bias") for t in tensors),
        "mamba_num_heads": ssm["heads"],
        "mamba_head_dim": ssm["head_dim"],
        "n_groups": ssm["groups"],
        "ssm_state_size": ssm["state"],
        "conv_kernel": ssm["kernel"],
    }
    if sizes:
        hf["intermediate_size"] = sizes.pop()
    if experts and int(get("expert_gating_func", SIGMOID)) != SIGMOID:
        raise CheckpointError(
            f"the {arch} GGUF file's expert_gating_func is {get('expert_gating_func')}; eqllm's "
            f"nemotron_h scores experts by sigmoid ({SIGMOID})"
        )
    if experts:  # the dense MLP size, which no layer uses, is the experts' in the file
        groups, ff_size = int(get("expert_group_count", 1)), hf.get("intermediate_size")
        hf |= {
            "n_routed_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            "n_shared_experts": int(get("expert_shared_count", 1)),
            "moe_intermediate_size": int(get("expert_feed_forward_length", ff_size)),
            "moe_shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "n_group": groups,
            # The converter writes no used-group count: every group may be chosen.
            "topk_group": int(get("expert_group_used_count", groups)),
        }
    return hf


# Granite 4.0-H ------------------------------------------------------------------------------


def granite_metadata(hf: dict) -> dict[str, Any]:
    kinds = [granitemoehybrid.KINDS[t] for t in hf["layer_types"]]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    out = {
        # The converter writes 2**20 where rotary positions are off; the model's own is kept.
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "block_count": len(kinds),
        "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": [hf["num_key_value_heads"] if k == "full" else 0 for k in kinds],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
        "rope.freq_base": float(hf["rope_theta"]),
        "rope.dimension_count": head_dim,
        "rope.scaling.finetuned": hf["position_embedding_type"] == "rope",
        "expert_count": hf["num_local_experts"],
        "expert_shared_feed_forward_length": hf["shared_intermediate_size"],
        "attention.scale": float(hf["attention_multiplier"]),
        "embedding_scale": float(hf["embedding_multiplier"]),
        "residual_scale": float(hf["residual_multiplier"]),
        "logit_scale": float(hf["logits_scaling"]),
        **_ssm_metadata(hf, hf["mamba_d_conv"]),
    }
    if hf["num_local_experts"]:
        out["expert_used_count"] = hf["num_experts_per_tok"]
    return out


def granite_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)
    d, n = int(get("embedding_length")), int(get("block_count"))
    kv = _per_layer(get("attention.head_count_kv"), n)
    n_head = max(_per_layer(get("attention.head_count"), n))
    head_dim = int(get("attention.key_length", d // n_head))
    # llama.cpp's attention scale when the file has none (or 0): 1 / sqrt(head_dim).
    scale = float(get("attention.scale", 0.0))
    if np.float32(scale) in (0.0, np.float32(head_dim**-0.5)):
        scale = head_dim**-0.5
    experts = int(get("expert_count", 0))
    ffn = int(get("feed_forward_length"))
    ssm = _ssm_config(get, d)
    hf = {
        "hidden_size": d,
        "num_hidden_layers": n,
        "layer_types": ["attention" if h else "mamba" for h in kv],
        "num_attention_heads": n_head,
        "num_key_value_heads": max(kv) or n_head,
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp's default: rotary on, unless the file switches it off.
        "position_embedding_type": "rope" if get("rope.scaling.finetuned", True) else "nope",
        "attention_bias": any(t.endswith("attn_q.bias") for t in tensors),
        "embedding_multiplier": float(get("embedding_scale", 1.0)),
        "residual_multiplier": float(get("residual_scale", 1.0)),
        "logits_scaling": float(get("logit_scale", 1.0)),
        "attention_multiplier": scale,
        "num_local_experts": experts,
        "intermediate_size": ffn,
        "shared_intermediate_size": int(get("expert_shared_feed_forward_length", ffn)),
        "mamba_n_heads": ssm["heads"],
        "mamba_d_head": ssm["head_dim"],
        "mamba_n_groups": ssm["groups"],
        "mamba_d_state": ssm["state"],
        "mamba_d_conv": ssm["kernel"],
        "mamba_expand": ssm["inner"] // d,
    }
    if experts:
        hf["num_experts_per_tok"] = int(get("expert_used_count"))
    return hf
