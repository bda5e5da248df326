"""GGUF for Mamba-2 and Falcon-H1, as llama.cpp's converter (`Mamba2Model`, `FalconH1Model`)
writes them: A as -exp(A_log) and D as [heads, 1], `dt_bias` as `dt_proj.bias`, the conv1d
squeezed to [channels, kernel], the gated norm as [groups, inner / groups]; Falcon-H1's muP
multipliers folded into the weights (embedding, head, q/k/v/o, the MLP's gate and down, the
Mamba-2 in_proj rows z, x, B, C, dt and out_proj), so a file read back has none. Nemotron-H's
and Granite 4.0-H's Mamba-2 layers are written the same way (`eqllm.hub.gguf_granite`). See
`eqllm.hub.gguf_hybrid` for how an architecture is described."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def reader(field: Callable, arch: str) -> Callable:
    """get(key, default): the file's `{arch}.{key}` (KeyError if absent and no default); a
    float as the shortest decimal its float32 holds (1e-06, not 9.99999997e-07)."""

    def get(key: str, default: Any = None) -> Any:
        value = field(f"{arch}.{key}", default)
        if value is None:
            raise KeyError(f"{arch}.{key}")
        return float(str(np.float32(value))) if isinstance(value, float) else value

    return get


def mamba_names(name: str) -> list[str]:
    if name.endswith(".dt_bias"):
        return [name.removesuffix(".dt_bias") + ".dt_proj.bias"]
    return [name]


def mamba_sizes(hf: dict) -> tuple[int, int, int, int]:
    """(inner size, heads, groups, state size) of a Mamba2, Falcon-H1, Nemotron-H or Granite
    4.0-H config.json."""
    if "mamba_d_ssm" in hf:  # Falcon-H1
        return hf["mamba_d_ssm"], hf["mamba_n_heads"], hf["mamba_n_groups"], hf["mamba_d_state"]
    if "mamba_num_heads" in hf:  # Nemotron-H
        heads = hf["mamba_num_heads"]
        return heads * hf["mamba_head_dim"], heads, hf["n_groups"], hf["ssm_state_size"]
    if "mamba_n_heads" in hf:  # Granite 4.0-H
        heads = hf["mamba_n_heads"]
        return heads * hf["mamba_d_head"], heads, hf["mamba_n_groups"], hf["mamba_d_state"]
    inner = hf["num_heads"] * hf["head_dim"]
    return inner, hf["num_heads"], hf["n_groups"], hf["state_size"]


def _falcon_scale(name: str, t: np.ndarray, hf: dict) -> np.ndarray:
    """Falcon-H1's multipliers folded into one weight, as FalconH1Model.modify_tensors does."""
    get = lambda key: hf.get(key, 1.0)  # noqa: E731
    mlp = hf.get("mlp_multipliers") or (1.0, 1.0)
    if "down_proj" in name:
        return t * mlp[1]
    if "gate_proj" in name:
        return t * mlp[0]
    if "k_proj" in name:
        return t * get("key_multiplier") * get("attention_in_multiplier")
    if "q_proj" in name or "v_proj" in name:
        return t * get("attention_in_multiplier")
    if "o_proj" in name:
        return t * get("attention_out_multiplier")
    if "out_proj" in name:
        return t * get("ssm_out_multiplier")
    if "in_proj" in name:
        inner, _, groups, state = mamba_sizes(hf)
        gs = groups * state
        ends = np.cumsum([0, inner, inner, gs, gs])  # z, x, B, C, then dt to the end
        rows = np.searchsorted(ends, np.arange(t.shape[0]), side="right") - 1
        ssm = np.asarray(hf.get("ssm_multipliers") or (1.0,) * 5, t.dtype)
        return t * get("ssm_in_multiplier") * ssm[rows][:, None]
    if "lm_head" in name:
        return t * get("lm_head_multiplier")
    if "embed_tokens" in name:
        return t * get("embedding_multiplier")
    return t


def mamba_to_gguf(arch: str):
    def to_gguf(name: str, t: np.ndarray, hf: dict) -> list[tuple[str, np.ndarray]]:
        inner, _, groups, _ = mamba_sizes(hf)
        if name.endswith("conv1d.weight"):
            t = t.reshape(t.shape[0], -1)  # [channels, 1, kernel] -> [channels, kernel]
        elif name.endswith((".A_log", ".D")):
            t = t.reshape(*t.shape, 1)
        elif name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
            t = t.reshape(groups, inner // groups)
        if name.endswith(".A_log"):
            t = -np.exp(t)
        if arch == "falcon-h1":
            t = _falcon_scale(name, t, hf)
        return [(mamba_names(name)[0], t)]

    return to_gguf


def mamba_from_gguf(name: str, arrays: list[np.ndarray], hf: dict) -> np.ndarray:
    # Falcon-H1's multipliers stay in the weights: the config read back has none.
    t = arrays[0]
    if name.endswith(".A_log"):
        t = np.log(-t)
    if name.endswith("conv1d.weight"):
        return t[:, None, :]
    return t.reshape(-1) if name.endswith((".A_log", ".D", "norm.weight")) else t


def mamba_metadata(arch: str):
    def metadata(hf: dict) -> dict[str, Any]:
        inner, heads, groups, state = mamba_sizes(hf)
        falcon = arch == "falcon-h1"
        out = {
            # The converter writes 2**20 for Mamba-2 ("arbitrary"); the model's own is kept.
            "context_length": hf["max_position_embeddings"],
            "embedding_length": hf["hidden_size"],
            "feed_forward_length": hf["intermediate_size"] if falcon else 0,
            "attention.head_count": hf["num_attention_heads"] if falcon else 0,
            "block_count": hf["num_hidden_layers"],
            "ssm.conv_kernel": hf["mamba_d_conv"] if falcon else hf["conv_kernel"],
            "ssm.inner_size": inner,
            "ssm.state_size": state,
            "ssm.time_step_rank": heads,
            "ssm.group_count": groups,
            "attention.layer_norm_rms_epsilon": float(
                hf["rms_norm_eps"] if falcon else hf["layer_norm_epsilon"]
            ),
        }
        if falcon:
            out |= {
                "attention.head_count_kv": hf["num_key_value_heads"],
                "attention.key_length": hf["head_dim"],
                "attention.value_length": hf["head_dim"],
                "rope.freq_base": float(hf["rope_theta"]),
            }
        return out

    return metadata


def mamba_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)

    d, inner = int(get("embedding_length")), int(get("ssm.inner_size"))
    heads = int(get("ssm.time_step_rank"))
    common = {
        "hidden_size": d,
        "num_hidden_layers": int(get("block_count")),
        "max_position_embeddings": int(get("context_length", 2048)),
    }
    eps = float(get("attention.layer_norm_rms_epsilon", 1e-5))
    if arch == "mamba2":
        return common | {
            "num_heads": heads,
            "head_dim": inner // heads,
            "expand": inner // d,
            "state_size": int(get("ssm.state_size")),
            "n_groups": int(get("ssm.group_count")),
            "conv_kernel": int(get("ssm.conv_kernel")),
            "layer_norm_epsilon": eps,
        }
    n_head = int(get("attention.head_count"))
    return common | {
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", d // n_head)),
        "rms_norm_eps": eps,
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "mamba_d_ssm": inner,
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_n_groups": int(get("ssm.group_count")),
        "mamba_d_state": int(get("ssm.state_size")),
        "mamba_d_conv": int(get("ssm.conv_kernel")),
        # llama.cpp's Mamba-2 norms after the gate, and only where the file has the norm.
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensors,
        "mamba_norm_before_gate": False,
    }
