"""GGUF for GLM-4.5 (glm4_moe as llama.cpp's `glm4moe`) and DeepSeek-V2, DeepSeek-V3 and Kimi
K2 (deepseek_v2 and deepseek_v3 as its `deepseek2`), as llama.cpp's convert_hf_to_gguf.py writes
them (`Glm4MoeModel`, `DeepseekV2Model`).

transformers' GGUF loader reads neither architecture, so, as tests/test_gguf_hybrid.py does for
the hybrids, the references are the gguf package's own tables (tensor names, metadata keys), the
converter's transforms restated index by index from the Hugging Face folder eqllm writes (the
experts stacked, `kv_b_proj` split per head into `attn_k_b` transposed and `attn_v_b`, the
correction bias as `exp_probs_b.bias`), the tensors and shapes llama.cpp's loaders create, and
the metadata llama.cpp's files of the published models carry.
"""

import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from families import BY_NAME
from gguf_loaders import loader_tensors
from test_gguf_granite import _rewrite
from test_gguf_hybrid import (
    _mapped,
    check_metadata,
    check_q8_0,
    check_refused,
    check_tensors,
    f32_files,
)

import eqllm
from eqllm.hub.config import from_hf_config, to_hf_config
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf import check_exportable
from eqllm.hub.gguf_hybrid import ARCHS

gguf = pytest.importorskip("gguf")
NAMES = ["glm4_moe", "deepseek_v3", "deepseek_v2"]
ARCH = {"glm4_moe": "glm4moe", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}
PUBLISHED = Path(__file__).parent / "data" / "hf_configs"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return f32_files(tmp_path_factory)


def _lost(model, back):
    """What a GGUF file does not hold: the load-balancing loss's weight (training alone), read
    back as transformers' default."""
    return model.config.replace(moe={"aux_loss_coef": back.config.moe.aux_loss_coef})


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_gives_the_same_config_and_weights(written, name):
    model, _, _, _, tmp = written(name)
    back = eqllm.hub.from_pretrained(tmp / "m.gguf")
    assert back.config == _lost(model, back)
    # Renames, stacking and the split of kv_b_proj are exact (tests/test_families.py compares
    # the logits of the default entries' files).
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def _expected(arch, hf, tensors):
    """llama.cpp's tensors, from the Hugging Face tensors: experts stacked, kv_b_proj's rows of
    head h (nope key rows, then v rows) as attn_k_b[h] (transposed) and attn_v_b[h], the
    correction bias as exp_probs_b.bias, every other tensor renamed by the gguf package."""
    out = {}
    for name, w in tensors.items():
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        blk = f"blk.{i}." if i is not None else ""
        short = name.removeprefix(f"model.layers.{i}.") if i is not None else name
        if short.startswith("mlp.experts."):
            j, what = short.split(".")[2:4]
            out.setdefault(f"{blk}ffn_{what.removesuffix('_proj')}_exps.weight", {})[int(j)] = w
        elif short == "mlp.gate.e_score_correction_bias":
            out[blk + "exp_probs_b.bias"] = w
        elif short == "self_attn.kv_b_proj.weight":
            nope, per = hf["qk_nope_head_dim"], hf["qk_nope_head_dim"] + hf["v_head_dim"]
            heads = range(hf["num_attention_heads"])
            out[blk + "attn_k_b.weight"] = np.stack([w[h * per : h * per + nope].T for h in heads])
            out[blk + "attn_v_b.weight"] = np.stack(
                [w[h * per + nope : (h + 1) * per] for h in heads]
            )
        else:
            out[_mapped(arch, hf, name)] = w
    for key, experts in out.items():
        if isinstance(experts, dict):
            out[key] = np.stack([experts[j] for j in range(len(experts))])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_llama_cpps(written, name):
    """Every tensor is one of the architecture's in the gguf package's table (MODEL_TENSORS),
    and equals the converter's transform of the Hugging Face tensor."""
    _, hf, tensors, reader, _ = written(name)
    arch = ARCH[name]
    expected = _expected(arch, hf, tensors)
    check_tensors(reader, arch, hf["num_hidden_layers"], expected)


@pytest.mark.parametrize("name", NAMES)
def test_tensors_and_shapes_are_those_llama_cpps_loader_creates(written, name):
    _, hf, _, reader, _ = written(name)
    file = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert file == loader_tensors(hf)


def _expected_metadata(hf):
    """The converter's metadata (TextModel's, then Glm4MoeModel's or DeepseekV2Model's)."""
    rope = hf.get("rope_scaling") or {}
    meta = {
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "rope.freq_base": hf["rope_theta"],
        "expert_count": hf["n_routed_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
        "expert_shared_count": hf["n_shared_experts"],
        "expert_group_count": hf["n_group"],
        "expert_group_used_count": hf["topk_group"],
        "leading_dense_block_count": hf["first_k_dense_replace"],
        "expert_weights_scale": hf["routed_scaling_factor"],
    }
    if hf["model_type"] == "glm4_moe":
        return meta | {
            "block_count": hf["num_hidden_layers"],
            "attention.head_count_kv": hf["num_key_value_heads"],
            "attention.key_length": hf["head_dim"],
            "attention.value_length": hf["head_dim"],
            "rope.dimension_count": int(hf["head_dim"] * hf["partial_rotary_factor"]),
            "expert_gating_func": 2,
            "expert_weights_norm": hf["norm_topk_prob"],
            "nextn_predict_layers": 0,
        }
    latent, r = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    meta |= {
        "block_count": hf["num_hidden_layers"],
        "attention.head_count_kv": 1,
        "attention.q_lora_rank": hf["q_lora_rank"] or 0,
        "attention.kv_lora_rank": latent,
        "attention.key_length": latent + r,
        "attention.value_length": latent,
        "attention.key_length_mla": hf["qk_nope_head_dim"] + r,
        "attention.value_length_mla": hf["v_head_dim"],
        "rope.dimension_count": r,
        "expert_gating_func": 1 if hf["model_type"] == "deepseek_v2" else 2,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": rope["factor"],
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": rope["beta_fast"],
        "rope.scaling.yarn_beta_slow": rope["beta_slow"],
        "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"],
    }
    if hf["norm_topk_prob"]:
        meta["expert_weights_norm"] = True
    return meta


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_llama_cpps(written, name):
    _, hf, _, reader, _ = written(name)
    check_metadata(reader, ARCH[name], _expected_metadata(hf))


# Metadata of llama.cpp's files of the published models (as their model pages list it), from
# the published config.json files eqllm reads (tests/data/hf_configs).
_PUBLISHED = {
    "kimi-k2": {
        "block_count": 61,
        "expert_count": 384,
        "expert_used_count": 8,
        "expert_shared_count": 1,
        "expert_group_count": 1,
        "expert_group_used_count": 1,
        "leading_dense_block_count": 1,
        "expert_gating_func": 2,
        "expert_weights_norm": True,
        "expert_weights_scale": 2.827,
        "attention.head_count": 64,
        "attention.head_count_kv": 1,
        "attention.q_lora_rank": 1536,
        "attention.kv_lora_rank": 512,
        "attention.key_length": 576,
        "attention.value_length": 512,
        "attention.key_length_mla": 192,
        "attention.value_length_mla": 128,
        "rope.dimension_count": 64,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_log_multiplier": 0.1,
    },
    "deepseek-v3": {"expert_count": 256, "expert_group_count": 8, "expert_group_used_count": 4},
    "deepseek-v2-lite": {
        "block_count": 27,
        "expert_count": 64,
        "expert_used_count": 6,
        "expert_shared_count": 2,
        "expert_gating_func": 1,
        "attention.q_lora_rank": 0,
        "attention.key_length": 576,
        "attention.value_length": 512,
        "rope.scaling.yarn_log_multiplier": 0.0707,
    },
    "glm-4.5-air": {
        "expert_count": 128,
        "expert_used_count": 8,
        "expert_shared_count": 1,
        "leading_dense_block_count": 1,
        "expert_gating_func": 2,
        "expert_weights_norm": True,
        "attention.head_count": 96,
        "attention.head_count_kv": 8,
        "attention.key_length": 128,
        "rope.dimension_count": 64,
    },
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_published_models_are_written_with_llama_cpps_metadata(name):
    """The published DeepSeek-V3, Kimi K2, DeepSeek-V2-Lite and GLM-4.5-Air are written (their
    YaRN included) with the keys llama.cpp's files of them carry."""
    config = from_hf_config(json.loads((PUBLISHED / f"{name}.json").read_text()))
    check_exportable(config, "q8_0")
    arch = eqllm.hub.gguf.gguf_arch(config)
    meta = ARCHS[arch].metadata(to_hf_config(config))
    for key, value in _PUBLISHED[name].items():
        assert meta[key] == (pytest.approx(value) if isinstance(value, float) else value), key


@pytest.mark.parametrize("name", ["glm4_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_q8_0_keeps_llama_cpps_f32_tensors(written, name, tmp_path):
    """Q8_0 quantizes the 2-D and stacked expert weights (attn_k_b, whose rows of qk_nope dims
    Q8_0's blocks of 32 do not divide, as F16), each within its block's rounding of the f32
    file's; norms, biases, the correction bias and the router stay F32."""
    model, _, _, f32, _ = written(name)
    check_q8_0(model, f32, tmp_path, name)


def test_what_the_architectures_cannot_hold_is_refused_by_name(tmp_path):
    refused = functools.partial(check_refused, tmp_path)

    v3 = "GGUF architecture 'deepseek2'"
    bias = {"qkv_bias": True, "out_bias": True}
    refused("deepseek_v3", f"attention.qkv_bias=True: {v3}", attention=bias)
    refused("deepseek_v3", f"rope_interleave=False: {v3}", attention={"rope_interleave": False})
    refused("deepseek_v3", f"moe.shared_d_ff=None: {v3}", moe={"shared_d_ff": None})
    yarn = dataclasses.asdict(BY_NAME["deepseek_v3"].config.positions.scaling) | {"mscale": 1.0}
    refused("deepseek_v3", f"positions.scaling.mscale=1.0: {v3}", positions={"scaling": yarn})
    # DeepSeek-V2's groups, each scored by its best expert (llama.cpp sums the best two).
    refused("deepseek_v2", f"moe.group_score='max': {v3}", moe={"n_groups": 4, "topk_groups": 2})
    refused(
        "glm4_moe",
        "positions.fraction=0.3: GGUF architecture 'glm4moe'",
        positions={"fraction": 0.3},
    )
    refused("glm4_moe-air", "positions.scaling.kind='yarn'")  # llama.cpp's glm4moe: no YaRN here
    assert not (tmp_path / "x.gguf").exists()


def test_multi_token_prediction_layers_are_left_out_with_a_message(written, tmp_path, caplog):
    """llama.cpp's GLM-4.5 files count their multi-token-prediction layer in block_count
    (`nextn_predict_layers`) and hold it as a further block: read as the model without it."""
    model, hf, _, reader, tmp = written("glm4_moe")
    n, d = hf["num_hidden_layers"], hf["hidden_size"]
    extra = {f"blk.{n}.nextn.eh_proj.weight": np.ones((d, 2 * d), np.float32)}
    extra[f"blk.{n}.attn_norm.weight"] = np.ones(d, np.float32)
    changed = {"glm4moe.block_count": n + 1, "glm4moe.nextn_predict_layers": 1}
    _rewrite(reader, tmp_path / "mtp.gguf", "glm4moe", changed, extra=extra)
    with caplog.at_level(logging.WARNING, logger="eqllm.hub"):
        back = eqllm.hub.from_pretrained(tmp_path / "mtp.gguf")
    assert back.config == eqllm.hub.from_pretrained(tmp / "m.gguf").config
    assert f"layers [{n}] past its {n} (multi-token prediction" in caplog.text


def test_a_file_as_the_converter_writes_it_reads_back(written, tmp_path):
    """The converter writes no q_lora_rank without a query latent and no expert_weights_norm
    when false (DeepSeek-V2-Lite); llama.cpp reads a file without expert_gating_func as softmax:
    such a file reads back as the same DeepSeek-V2."""
    model, _, _, reader, _ = written("deepseek_v2")
    left_out = {f"deepseek2.{k}" for k in ("attention.q_lora_rank", "expert_gating_func")}
    _rewrite(reader, tmp_path / "c.gguf", "deepseek2", {}, left_out)
    back = eqllm.hub.from_pretrained(tmp_path / "c.gguf")
    assert back.config == _lost(model, back)


def test_experts_scored_otherwise_than_by_sigmoid_are_refused_for_glm(written, tmp_path):
    _, _, _, reader, _ = written("glm4_moe")
    _rewrite(reader, tmp_path / "s.gguf", "glm4moe", {"glm4moe.expert_gating_func": 1})
    with pytest.raises(CheckpointError, match="expert_gating_func is 1"):
        eqllm.hub.from_pretrained(tmp_path / "s.gguf")


@pytest.mark.parametrize("alone", [True, False])
def test_files_of_the_older_converter_with_attn_kv_b_read_back(written, tmp_path, alone):
    """Before mid-2025 the converter kept kv_b_proj whole as attn_kv_b (first alone, then beside
    attn_k_b and attn_v_b), with the head sizes as key_length and value_length."""
    model, hf, tensors, reader, _ = written("deepseek_v3")
    n, a = hf["num_hidden_layers"], "deepseek2.attention."
    k, v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
    changed = {
        a + "key_length": k,
        a + "value_length": v,
        a + "head_count_kv": hf["num_attention_heads"],
    }
    left_out = {a + "key_length_mla", a + "value_length_mla"}
    if alone:
        left_out |= {f"blk.{i}.attn_{p}_b.weight" for i in range(n) for p in "kv"}
    kv_b = {
        f"blk.{i}.attn_kv_b.weight": tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        for i in range(n)
    }
    _rewrite(reader, tmp_path / "old.gguf", "deepseek2", changed, left_out, extra=kv_b)
    back = eqllm.hub.from_pretrained(tmp_path / "old.gguf")
    assert back.config == _lost(model, back)
    for x, y in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
