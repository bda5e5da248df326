"""GGUF for GLM-4.5 (`glm4moe`) and DeepSeek-V2, DeepSeek-V3 and Kimi K2 (`deepseek2`), as
llama.cpp's converter writes them (its `Glm4MoeModel` and `DeepseekV2Model`).

Both architectures hold the same mixture: the routed experts stacked into [experts, ...]
tensors (`ffn_{gate,up,down}_exps`), the router `ffn_gate_inp` (F32), the correction bias
`e_score_correction_bias` as `exp_probs_b.bias`, the shared experts as
`ffn_{gate,up,down}_shexp`, the dense prefix's MLP as `ffn_{gate,up,down}`, and the routing in
the `expert_*` keys: `expert_gating_func` (1 softmax, 2 sigmoid), `expert_group_count` and
`expert_group_used_count` (llama.cpp scores a group by the sum of its two best experts, as
DeepSeek-V3 and GLM-4.5 do), `expert_weights_scale`, `expert_weights_norm` and
`leading_dense_block_count`.

- glm4moe: the attention tensors as transformers holds them (llama.cpp rotates the leading
  `rope.dimension_count` dims of each head in halves, as transformers does: no permutation),
  `post_attention_layernorm` as `post_attention_norm`. llama.cpp's files count the
  multi-token-prediction layers in `block_count` (`nextn_predict_layers`); they are read
  without them, as the Hugging Face import leaves them out.
- deepseek2: latent attention run as multi-query attention over the latent
  (`attention.head_count_kv` 1, `key_length` kv_lora_rank + rotary dims, `value_length`
  kv_lora_rank; the model's own head sizes in `key_length_mla` / `value_length_mla`);
  `kv_b_proj` split per head into `attn_k_b` (the key rows transposed: [heads, kv_lora_rank,
  nope]) and `attn_v_b` ([heads, v, kv_lora_rank]), with no `attn_kv_b` kept, as the current
  converter writes it; YaRN in `rope.scaling.*`, DeepSeek's `mscale_all_dim` as
  `yarn_log_multiplier` (0.1 x mscale_all_dim, which llama.cpp divides back). A file's
  `expert_gating_func` says which family reads it: sigmoid DeepSeek-V3 (Kimi K2 too), softmax
  DeepSeek-V2 (llama.cpp's default when the key is absent).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from eqllm import families
from eqllm.families._rope import rope_params
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf_mamba import reader

log = logging.getLogger("eqllm.hub")

SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func
# The family a file of an architecture several families are written as is read as, before its
# metadata names the one it is (`deepseek_config`).
READ_AS = {"deepseek2": "deepseek_v3"}
# The architectures whose files hold RoPE scaling (YaRN: every published DeepSeek-V3 and Kimi K2).
SCALED = frozenset({"deepseek2"})
_BLOCK = re.compile(r"blk\.(\d+)\.")
# Files of the converter before mid-2025 hold kv_b_proj whole as attn_kv_b (alone, later beside
# attn_k_b and attn_v_b) and name the head sizes key_length / value_length; config.json's private
# `_gguf_kv_b` lists which of these tensors such a file holds, so that each one is read.
_KV_B = ("kv_b_proj", "k_b_proj", "v_b_proj")


# Tensors ----------------------------------------------------------------------------------


def moe_names(name: str, hf: dict) -> list[str]:
    """The names the gguf package maps: the correction bias as `...e_score_correction.bias`,
    `kv_b_proj` as its two halves `k_b_proj` and `v_b_proj` (or as an older file holds it,
    `_gguf_kv_b`); [name] for any other tensor."""
    if name.endswith(".e_score_correction_bias"):
        return [name.removesuffix("_bias") + ".bias"]
    if name.endswith(".kv_b_proj.weight"):
        stem = name.removesuffix("kv_b_proj.weight")
        return [f"{stem}{part}.weight" for part in hf.get("_gguf_kv_b", _KV_B[1:])]
    return [name]


def moe_to_gguf(name: str, t: np.ndarray, hf: dict) -> list[tuple[str, np.ndarray]]:
    names = moe_names(name, hf)
    if len(names) == 1:
        return [(names[0], t)]
    # kv_b_proj [heads * (nope + v), kv_lora_rank], each head's nope key rows then its v rows
    heads, nope = hf["num_attention_heads"], hf["qk_nope_head_dim"]
    kv = t.reshape(heads, -1, t.shape[-1])
    k_b = np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1))  # [heads, kv_lora_rank, nope]
    return [(names[0], k_b), (names[1], np.ascontiguousarray(kv[:, nope:]))]


def moe_from_gguf(name: str, arrays: list[np.ndarray], hf: dict) -> np.ndarray:
    if len(arrays) == 1 or arrays[0].ndim == 2:  # kv_b_proj whole where an older file has it
        return arrays[0]
    k_b, v_b = arrays  # [heads, kv_lora_rank, nope], [heads, v, kv_lora_rank]
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return kv.reshape(-1, kv.shape[-1])


# Metadata ---------------------------------------------------------------------------------


def _common(hf: dict, gating: int) -> dict[str, Any]:
    """The keys both converters write (TextModel's, and the mixture's)."""
    return {
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
        "rope.freq_base": float(rope_params(hf).get("rope_theta", hf.get("rope_theta"))),
        "expert_count": hf["n_routed_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
        "expert_shared_count": hf.get("n_shared_experts") or 0,
        "expert_group_count": hf.get("n_group") or 1,
        "expert_group_used_count": hf.get("topk_group") or 1,
        "leading_dense_block_count": hf.get("first_k_dense_replace") or 0,
        "expert_weights_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "expert_gating_func": gating,
    }


def _common_config(get: Callable) -> dict[str, Any]:
    return {
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": int(get("attention.head_count")),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0)) or None,
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
    }


def _skip_nextn(arch: str, get: Callable, tensors: set[str]) -> int:
    """The model's layers: `block_count` less the multi-token-prediction layers, whose tensors
    are left out (with a message, as the Hugging Face import leaves them out)."""
    n = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    beyond = sorted({int(m[1]) for t in tensors if (m := _BLOCK.match(t)) and int(m[1]) >= n})
    if beyond:
        log.warning(
            "skipping the %s GGUF file's layers %s past its %d (multi-token prediction, which "
            "eqllm does not use)",
            arch,
            beyond,
            n,
        )
    return n


def glm_metadata(hf: dict) -> dict[str, Any]:
    head_dim = hf["head_dim"]
    fraction = hf.get("partial_rotary_factor") or rope_params(hf).get("partial_rotary_factor")
    return {
        **_common(hf, SIGMOID),
        "block_count": hf["num_hidden_layers"] + (hf.get("num_nextn_predict_layers") or 0),
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": int(head_dim * fraction),
        "expert_weights_norm": bool(hf["norm_topk_prob"]),
        "nextn_predict_layers": hf.get("num_nextn_predict_layers") or 0,
    }


def _gating(get: Callable, arch: str, want: int | None = None) -> int:
    """The file's expert_gating_func (llama.cpp reads a file without it as softmax)."""
    gating = int(get("expert_gating_func", SOFTMAX))
    if gating not in (SOFTMAX, SIGMOID) or (want is not None and gating != want):
        raise CheckpointError(
            f"the {arch} GGUF file's expert_gating_func is {gating}; eqllm reads "
            f"{'sigmoid (2)' if want == SIGMOID else 'softmax (1) or sigmoid (2)'} scores here"
        )
    return gating


def glm_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)
    _gating(get, arch, want=SIGMOID)
    head_dim = int(get("attention.key_length"))
    return {
        **_common_config(get),
        "num_hidden_layers": _skip_nextn(arch, get, tensors),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "num_nextn_predict_layers": 0,
    }


def _yarn_metadata(hf: dict) -> dict[str, Any]:
    """TextModel's `rope.scaling.*` keys for YaRN, and DeepseekV2Model's log multiplier."""
    rope = rope_params(hf)
    if rope["rope_type"] == "default":
        return {}
    out = {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }
    for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if rope.get(key) is not None:
            out[f"rope.scaling.{name}"] = float(rope[key])
    if rope.get("mscale_all_dim") is not None:
        out["rope.scaling.yarn_log_multiplier"] = 0.1 * rope["mscale_all_dim"]
    return out


def _yarn_config(get: Callable, field: Callable, arch: str) -> dict[str, Any] | None:
    kind = field(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise CheckpointError(
            f"the {arch} GGUF file's rope.scaling.type is {kind!r}; eqllm reads 'yarn' here"
        )
    rope = {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
    }
    for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if field(f"{arch}.rope.scaling.{name}") is not None:
            rope[key] = float(get(f"rope.scaling.{name}"))
    if field(f"{arch}.rope.scaling.yarn_log_multiplier") is not None:
        # DeepSeek's mscale and mscale_all_dim are equal where eqllm writes the file
        # (`Family.gguf_refuses`): 10 x the shortest decimal the float32 holds, to 12 digits.
        mscale = float(f"{get('rope.scaling.yarn_log_multiplier') * 10:.12g}")
        rope["mscale"] = rope["mscale_all_dim"] = mscale
    return rope


def deepseek_metadata(hf: dict) -> dict[str, Any]:
    latent, rope = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    out = {
        **_common(hf, SOFTMAX if hf["model_type"] == "deepseek_v2" else SIGMOID),
        "block_count": hf["num_hidden_layers"],
        "attention.head_count_kv": 1,
        # The converter writes no q_lora_rank without a query latent; llama.cpp then requires
        # it unless the depth is one of its "lite" models' (26 or 27): 0 loads at any depth.
        "attention.q_lora_rank": hf.get("q_lora_rank") or 0,
        "attention.kv_lora_rank": latent,
        "attention.key_length": latent + rope,
        "attention.value_length": latent,
        "attention.key_length_mla": hf["qk_nope_head_dim"] + rope,
        "attention.value_length_mla": hf["v_head_dim"],
        "rope.dimension_count": rope,
        **_yarn_metadata(hf),
    }
    if hf.get("norm_topk_prob"):  # the converter writes it only when true
        out["expert_weights_norm"] = True
    return out


def deepseek_config(field: Callable, arch: str, tensors: set[str]) -> dict[str, Any]:
    get = reader(field, arch)
    family = families.get("deepseek_v3" if _gating(get, arch) == SIGMOID else "deepseek_v2")
    rope = int(get("rope.dimension_count"))
    n_head = int(get("attention.head_count"))
    mla = "_mla" if field(f"{arch}.attention.key_length_mla") is not None else ""
    hf = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **_common_config(get),
        "num_hidden_layers": _skip_nextn(arch, get, tensors),
        "num_key_value_heads": n_head,  # the file's 1 is the latent run as one key/value head
        "q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_nope_head_dim": int(get(f"attention.key_length{mla}")) - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(get(f"attention.value_length{mla}")),
        "attention_bias": False,
        "rope_scaling": _yarn_config(get, field, arch),
    }
    if "blk.0.attn_kv_b.weight" in tensors:
        hf["_gguf_kv_b"] = [p for p in _KV_B if f"blk.0.attn_{p[:-5]}.weight" in tensors]
    if family.name == "deepseek_v2":
        if hf.pop("norm_topk_prob"):
            raise CheckpointError(
                f"the {arch} GGUF file's expert_weights_norm is true with softmax scores; "
                "eqllm's deepseek_v2 does not renormalise the chosen weights"
            )
        grouped = hf["n_group"] > 1
        hf["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    else:
        hf |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True}
    return hf
