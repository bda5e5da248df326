"""GGUF for the Mamba-2 hybrids with attention layers, Nemotron-H (nemotron_h, and with experts
nemotron_h_moe) and Granite 4.0-H (granitemoehybrid, with experts and dense), as llama.cpp's
convert_hf_to_gguf.py writes them (`NemotronHModel`, `GraniteHybridModel`).

transformers' GGUF loader reads neither architecture, so, as tests/test_gguf_hybrid.py does for
the other hybrids, the references are the gguf package's own tables and the converter's
transforms restated row by row from the Hugging Face folder eqllm writes: q/k rows in llama.cpp's
rotary order, Granite's fused `input_linear` split in halves, Mamba-2's -exp(A_log), [heads, 1],
squeezed conv1d and grouped norm; and the per-layer metadata llama.cpp reads each layer's kind
from.
"""

import equinox as eqx
import jax
import numpy as np
import pytest
from families import BY_NAME
from test_gguf_hybrid import (
    _array,
    _logits,
    _mapped,
    check_metadata,
    check_q8_0,
    check_tensors,
    f32_files,
)

import eqllm
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf_granite import permute

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
NAMES = ["nemotron_h", "nemotron_h_moe", "granitemoehybrid", "granitemoehybrid_dense"]
ARCH = {
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h_moe",
    "granitemoehybrid": "granitehybrid",
    "granitemoehybrid_dense": "granitehybrid",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return f32_files(tmp_path_factory)


def _lost(model, back):
    """What a GGUF file does not hold: Mamba-2's chunk length (a schedule, not the function)
    and the load-balancing loss's weight (training alone), read back as transformers' defaults;
    and Nemotron-H's dense MLP size when every feed-forward layer is experts (no layer uses it)."""
    lost = {"linear": {"chunk_size": back.config.linear.chunk_size}}
    if model.config.moe is not None:
        lost["moe"] = {"aux_loss_coef": back.config.moe.aux_loss_coef}
        if model.config.family == "nemotron_h":
            lost["mlp"] = {"d_ff": back.config.mlp.d_ff}
    return model.config.replace(**lost)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_gives_the_same_config_and_weights(written, name):
    model, _, _, _, tmp = written(name)
    back = eqllm.hub.from_pretrained(tmp / "m.gguf")
    assert back.config == _lost(model, back)
    # Every weight comes back to within float32 rounding of -exp(A_log); the permutations and
    # splits are exact.
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=3e-7)


# tests/test_families.py reads the default entries' files back and compares logits by default.
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_gives_the_same_logits(written, name):
    model, _, _, _, tmp = written(name)
    ours = _logits(model)
    back = _logits(eqllm.hub.from_pretrained(tmp / "m.gguf"))
    np.testing.assert_allclose(back, ours, rtol=0, atol=1e-5 * np.abs(ours).max())


def _rotary_rows(n: int, head_dim: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, row 2j + p holds transformers' row p * half + j."""
    half = head_dim // 2
    return np.array(
        [h * head_dim + p * half + j for h in range(n) for j in range(half) for p in range(2)]
    )


def _n_layers(hf):
    """Nemotron-H's config.json gives its depth as the list of layer kinds alone."""
    return hf.get("num_hidden_layers") or len(hf["layers_block_type"])


def _named(tensor, bid):
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


def _expected(arch, hf, tensors):
    """llama.cpp's tensors of a Nemotron-H or Granite 4.0-H file, from the Hugging Face ones."""
    M = gguf.MODEL_TENSOR
    nemotron = arch.startswith("nemotron_h")
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    groups = hf["n_groups"] if nemotron else hf["mamba_n_groups"]
    experts = hf.get("num_local_experts", 0) > 0
    out = {}
    for name, w in tensors.items():
        i = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith("q_proj.weight"):
            w = w[_rotary_rows(n_head, head_dim)]
        elif name.endswith("k_proj.weight"):
            w = w[_rotary_rows(n_kv, head_dim)]
        elif name.endswith(".A_log"):
            w = -np.exp(w)[:, None]
        elif name.endswith(".D"):
            w = w[:, None]
        elif name.endswith("conv1d.weight"):
            w = w[:, 0, :]
        elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
            w = w.reshape(groups, -1)
        if name.endswith("block_sparse_moe.input_linear.weight"):
            ff = hf["intermediate_size"]
            out[_named(M.FFN_GATE_EXP, i)], out[_named(M.FFN_UP_EXP, i)] = w[:, :ff], w[:, ff:]
        elif name.endswith("shared_mlp.input_linear.weight"):
            ff = hf["shared_intermediate_size"]
            gate, up = (M.FFN_GATE_SHEXP, M.FFN_UP_SHEXP) if experts else (M.FFN_GATE, M.FFN_UP)
            out[_named(gate, i)], out[_named(up, i)] = w[:ff], w[ff:]
        elif name.endswith("shared_mlp.output_linear.weight") and not experts:
            out[_named(M.FFN_DOWN, i)] = w
        elif ".mixer.experts." in name:  # Nemotron 3: per-expert tensors stacked in order
            j, kind = int(name.split(".")[5]), M.FFN_UP_EXP if "up_proj" in name else M.FFN_DOWN_EXP
            out.setdefault(_named(kind, i), {})[j] = w
        elif name.endswith("gate.e_score_correction_bias"):
            out[gguf.TENSOR_NAMES[M.FFN_EXP_PROBS_B].format(bid=i) + ".bias"] = w
        else:
            hf_n = {**hf, "num_hidden_layers": _n_layers(hf)}
            out[_mapped(arch, hf_n, name.replace(".dt_bias", ".dt_proj.bias"))] = w
    return {
        k: np.stack([v[j] for j in range(len(v))]) if isinstance(v, dict) else v
        for k, v in out.items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_llama_cpps(written, name):
    """Every tensor is one of the architecture's in the gguf package's table (MODEL_TENSORS),
    and equals the converter's transform of the Hugging Face tensor."""
    _, hf, tensors, reader, _ = written(name)
    arch = ARCH[name]
    expected = _expected(arch, hf, tensors)
    check_tensors(reader, arch, _n_layers(hf), expected, rtol=1e-6)


def _expected_metadata(model, hf):
    """The converter's metadata (TextModel, LlamaModel, GraniteModel, GraniteMoeModel,
    GraniteHybridModel, NemotronHModel), the layer kinds from eqllm's config."""
    kinds = model.config.layer_kinds()
    nemotron = model.config.family == "nemotron_h"
    experts = model.config.moe is not None
    kv = [hf["num_key_value_heads"] if k == "full" else 0 for k in kinds]
    meta = {
        "embedding_length": hf["hidden_size"],
        "block_count": len(kinds),
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": kv,
        "rope.scaling.finetuned": hf.get("position_embedding_type") == "rope",
    }
    if nemotron:
        heads = hf["mamba_num_heads"]
        ff = hf["moe_intermediate_size" if experts else "intermediate_size"]
        meta |= _nemotron_experts(hf) if experts else {}
        return meta | {
            "ssm.conv_kernel": hf["conv_kernel"],
            "ssm.inner_size": heads * hf["mamba_head_dim"],
            "ssm.state_size": hf["ssm_state_size"],
            "ssm.time_step_rank": heads,
            "ssm.group_count": hf["n_groups"],
            "feed_forward_length": [ff if k == "ffn" else 0 for k in kinds],
            "attention.key_length": hf["head_dim"],
            "attention.value_length": hf["head_dim"],
            # The converter's rms_norm_eps, which the published config.json files give equal
            # to layer_norm_epsilon (the one transformers reads, and eqllm writes).
            "attention.layer_norm_rms_epsilon": hf["layer_norm_epsilon"],
        }
    meta |= {
        "ssm.conv_kernel": hf["mamba_d_conv"],
        "ssm.inner_size": hf["mamba_expand"] * hf["hidden_size"],
        "ssm.state_size": hf["mamba_d_state"],
        "ssm.time_step_rank": hf["mamba_n_heads"],
        "ssm.group_count": hf["mamba_n_groups"],
        "feed_forward_length": hf["intermediate_size"],
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "rope.freq_base": hf["rope_theta"],
        "rope.dimension_count": hf["hidden_size"] // hf["num_attention_heads"],
        "expert_count": hf["num_local_experts"],
        "expert_shared_feed_forward_length": hf["shared_intermediate_size"],
        "attention.scale": hf["attention_multiplier"],
        "embedding_scale": hf["embedding_multiplier"],
        "residual_scale": hf["residual_multiplier"],
        "logit_scale": hf["logits_scaling"],
    }
    if hf["num_local_experts"]:
        meta["expert_used_count"] = hf["num_experts_per_tok"]
    return meta


def _nemotron_experts(hf):
    """NemotronHModel.set_gguf_parameters' expert keys (is_moe), and two it leaves out that
    llama.cpp's loader reads: the groups chosen and the sigmoid gating."""
    return {
        "expert_count": hf["n_routed_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_shared_count": hf["n_shared_experts"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
        "expert_shared_feed_forward_length": hf["moe_shared_expert_intermediate_size"],
        "expert_weights_norm": hf["norm_topk_prob"],
        "expert_weights_scale": hf["routed_scaling_factor"],
        "expert_group_count": hf["n_group"],
        "expert_group_used_count": hf["topk_group"],
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
    }


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_llama_cpps(written, name):
    model, hf, _, reader, _ = written(name)
    check_metadata(reader, ARCH[name], _expected_metadata(model, hf))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granitemoehybrid", "nemotron_h_moe"])
def test_q8_0_keeps_llama_cpps_f32_tensors(written, name, tmp_path):
    """Q8_0 quantizes the 2-D and stacked expert weights, each within its block's rounding of
    the f32 file's; norms, vectors, ssm_a/ssm_d, the conv1d kernel and the router stay F32."""
    model, _, _, f32, _ = written(name)
    check_q8_0(model, f32, tmp_path, name)


def test_what_the_architectures_cannot_hold_is_refused_by_name(tmp_path):
    def refused(config, match):
        model = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
        with pytest.raises(eqllm.ConfigError, match=match) as error:
            eqllm.hub.save_gguf(model, tmp_path / "x.gguf")
        assert "\n" not in str(error.value)

    nemotron = BY_NAME["nemotron_h"].config
    refused(nemotron.replace(linear={"dt_max": 0.1}), r"linear.dt_max=0.1: .*'nemotron_h'")
    granite = BY_NAME["granitemoehybrid"].config
    refused(granite.replace(linear={"dt_min": 0.01}), r"linear.dt_min=0.01: .*'granitehybrid'")
    # Attention layers alone: the converter's granite or granitemoe architecture.
    refused(granite.replace(linear=None), r"linear=None: GGUF architecture 'granitehybrid'")
    # With experts the architecture is nemotron_h_moe, and the refusal names it.
    experts = BY_NAME["nemotron_h_moe"].config
    refused(experts.replace(linear={"dt_max": 0.1}), r"dt_max=0.1: .*'nemotron_h_moe'")
    assert not (tmp_path / "x.gguf").exists()


def _rewrite(reader, path, arch, changed, left_out=(), extra=None):
    """`reader`'s file written again to `path`, keys in `changed` given new values (a uint32 where
    the file has no such key) and those in `left_out` (and tensors of those names) left out, and
    the tensors `extra` (name -> array) added."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in left_out:
            continue
        value = changed.get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for key in changed.keys() - reader.fields.keys():
        writer.add_uint32(key, changed[key])
    for t in reader.tensors:
        if t.name not in left_out:
            writer.add_tensor(t.name, _array(t))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_experts_scored_otherwise_than_by_sigmoid_are_refused(written, tmp_path):
    """A nemotron_h_moe file whose expert_gating_func is softmax (1) is not read as sigmoid."""
    _, _, _, reader, _ = written("nemotron_h_moe")
    _rewrite(
        reader, tmp_path / "s.gguf", "nemotron_h_moe", {"nemotron_h_moe.expert_gating_func": 1}
    )
    with pytest.raises(CheckpointError, match="expert_gating_func is 1"):
        eqllm.hub.from_pretrained(tmp_path / "s.gguf")


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe", "granitemoehybrid_dense"])
def test_a_file_as_the_converter_writes_it_reads_back(written, name, tmp_path):
    """Where the converter's metadata differs from eqllm's (it writes context_length 2^20 when
    attention does not rotate, no attention.key_length for Granite, whose head size is then
    hidden_size / heads, and no expert_gating_func for Nemotron-H's experts, then read as
    sigmoid), the file reads back as the same model with that context length."""
    model, _, _, reader, _ = written(name)
    arch = ARCH[name]
    left_out = {f"{arch}.attention.key_length", f"{arch}.attention.value_length"}
    if arch == "nemotron_h_moe":
        left_out = {f"{arch}.expert_gating_func"}
    elif arch == "nemotron_h":
        left_out = set()
    _rewrite(reader, tmp_path / "c.gguf", arch, {f"{arch}.context_length": 2**20}, left_out)
    back = eqllm.hub.from_pretrained(tmp_path / "c.gguf")
    assert back.config == _lost(model, back).replace(max_seq_len=2**20)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=3e-7)


def test_q_and_k_biases_take_the_rows_of_their_weights():
    """Granite's attention biases (attention_bias) go through the converter's permutation as
    the weights' rows do; reading undoes it."""
    rng = np.random.default_rng(0)
    for n_head, n_kv in ((4, 4), (4, 2)):
        weight, bias = rng.standard_normal((n_kv * 8, 5)), rng.standard_normal(n_kv * 8)
        rows = _rotary_rows(n_kv, 8)
        for t in (weight, bias):
            np.testing.assert_array_equal(permute(t, n_head, n_kv), t[rows])
            np.testing.assert_array_equal(permute(t[rows], n_head, n_kv, back=True), t)
