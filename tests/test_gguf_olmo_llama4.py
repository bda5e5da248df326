"""GGUF for OLMo 2 and OLMo 3 (llama.cpp's olmo2 architecture, which its converter writes both
as) and Llama 4's language model (llama4, Scout's layout and Maverick's dense layers between
expert layers), as llama.cpp's convert_hf_to_gguf.py writes them (`Olmo2Model`, `Llama4Model`).

transformers' GGUF loader reads neither architecture, so, as tests/test_gguf_hybrid.py does,
the references are the gguf package's per-architecture tables and key names, and the
converter's transforms and metadata restated here from the Hugging Face folder eqllm writes
(OLMo's tensors renamed only, no q/k permutation; Llama 4's fused `gate_up_proj` split into gate
and up and transposed, `down_proj` transposed; OLMo 3's window and per-layer pattern).

llama.cpp fixes Llama 4's chunk (8192), the global/NoPE period (4) and the temperature tuning
(floor 8192, scale 0.1), which the family list's tiny Llama 4 sets smaller: here it takes
llama.cpp's, and the tiny OLMo 3 one RoPE base on every layer and no YaRN (llama.cpp's olmo2
rotates windowed layers with the full layers' base).
"""

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_gguf_granite import _rewrite
from test_gguf_hybrid import (
    _logits,
    _mapped,
    _model,
    check_metadata,
    check_q8_0,
    check_refused,
    check_tensors,
    f32_files,
)

import eqllm
from eqllm.hub.config import from_hf_config
from eqllm.hub.files import CheckpointError
from eqllm.hub.gguf import check_exportable

gguf = pytest.importorskip("gguf")
DATA = Path(__file__).parent / "data" / "hf_configs"
NAMES = ["olmo2", "olmo3", "llama4", "llama4-maverick"]
ARCH = {"olmo2": "olmo2", "olmo3": "olmo2", "llama4": "llama4", "llama4-maverick": "llama4"}
LLAMA_CPP = {
    "attention": {
        "chunk_size": 8192,
        "global_every": 4,
        "temperature_floor": 8192,
        "temperature_scale": 0.1,
    },
    "positions": {"nope_every": 4},
}
OVERRIDES = {
    "olmo3": {"positions": {"local_theta": 10000.0, "scaling": None}},
    "llama4": LLAMA_CPP,
    "llama4-maverick": LLAMA_CPP,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return f32_files(tmp_path_factory, OVERRIDES)


@pytest.mark.parametrize(
    "name",
    [n if n != "llama4-maverick" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES],
)
def test_round_trip_gives_the_same_model_and_logits(written, name):
    """Read back, the file is the same family with the same config and the very weights (F32,
    moved but not changed), so the logits are equal."""
    model, _, _, _, tmp = written(name)
    back = eqllm.hub.from_pretrained(tmp / "m.gguf")
    # How the layer loop runs (the tiny OLMo 3 unrolls it) is no part of a checkpoint.
    assert back.config == model.config.replace(scan_layers=back.config.scan_layers)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    ours = _logits(model)
    np.testing.assert_allclose(_logits(back), ours, rtol=0, atol=1e-5 * np.abs(ours).max())


def _expected(arch, hf, tensors):
    """llama.cpp's tensors, from the Hugging Face tensors as the converter changes them."""
    out = {}
    for name, w in tensors.items():
        if name.endswith(".experts.gate_up_proj"):  # [E, d, 2 ff]: gate columns, then up
            ff = w.shape[-1] // 2
            stem = name.removesuffix("gate_up_proj")
            for part, cols in (("gate", w[:, :, :ff]), ("up", w[:, :, ff:])):
                key = _mapped(arch, hf, f"{stem}{part}_proj.weight")
                out[key] = np.einsum("edf->efd", cols)
        elif name.endswith(".experts.down_proj"):  # [E, ff, d] -> [E, d, ff]
            out[_mapped(arch, hf, name + ".weight")] = np.einsum("efd->edf", w)
        else:
            out[_mapped(arch, hf, name)] = w
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_llama_cpps(written, name):
    """Every tensor is one of the architecture's in the gguf package's table (MODEL_TENSORS),
    and equals the converter's transform of the Hugging Face tensor."""
    _, hf, tensors, reader, _ = written(name)
    arch = ARCH[name]
    expected = _expected(arch, hf, tensors)
    file = check_tensors(reader, arch, hf["num_hidden_layers"], expected)
    if name == "llama4-maverick":  # dense layers between the expert layers, as llama.cpp reads
        assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight"} <= set(file)
        assert "blk.0.ffn_gate_exps.weight" not in file and "blk.1.ffn_gate.weight" not in file


def _expected_metadata(name, hf):
    """The converter's metadata: TextModel's keys, then Olmo2Model's or LlamaModel's and
    Llama4Model's."""
    meta = {
        "block_count": hf["num_hidden_layers"],
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "attention.key_length": hf["head_dim"],
        "attention.value_length": hf["head_dim"],
    }
    if name.startswith("olmo"):
        # TextModel: rope_theta mirrored into rope_parameters unless they are per layer type.
        rope = dict(hf.get("rope_parameters") or {})
        if not {"full_attention", "sliding_attention"} & set(rope):
            rope.setdefault("rope_theta", hf["rope_theta"])
        meta["feed_forward_length"] = hf["intermediate_size"]
        meta["rope.freq_base"] = rope.get("full_attention", rope)["rope_theta"]
    if name == "olmo3":
        meta |= {
            "rope.freq_base_swa": rope["sliding_attention"]["rope_theta"],
            "attention.sliding_window": hf["sliding_window"],
            "attention.sliding_window_pattern": [
                t == "sliding_attention" for t in hf["layer_types"]
            ],
        }
    if name.startswith("llama4"):
        meta |= {
            # Llama4Model swaps the sizes: intermediate_size_mlp is the dense MLP's.
            "feed_forward_length": hf["intermediate_size_mlp"],
            "expert_feed_forward_length": hf["intermediate_size"],
            "rope.freq_base": hf["rope_theta"],
            "rope.dimension_count": hf["head_dim"],
            "expert_count": hf["num_local_experts"],
            "expert_used_count": hf["num_experts_per_tok"],
            "interleave_moe_layer_step": hf["interleave_moe_layer_step"],
            "vocab_size": hf["vocab_size"],
        }
    return meta


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_llama_cpps(written, name):
    _, hf, _, reader, _ = written(name)
    arch = ARCH[name]
    check_metadata(reader, arch, _expected_metadata(name, hf))
    if name != "olmo3":  # OLMo 2 has no window; Llama 4's chunks are llama.cpp's own
        assert f"{arch}.attention.sliding_window" not in reader.fields


def test_olmo3s_window_pattern_is_per_layer(written):
    """windowed, full, windowed: llama.cpp reads each layer's kind from the pattern."""
    _, _, _, reader, _ = written("olmo3")
    assert reader.fields["olmo2.attention.sliding_window_pattern"].contents() == [True, False, True]


@pytest.mark.parametrize("name", ["olmo3", pytest.param("llama4", marks=pytest.mark.slow)])
def test_q8_0_keeps_llama_cpps_f32_tensors(written, name, tmp_path):
    """Norms and the router stay F32; each quantized weight is within its block's rounding."""
    model, _, _, f32, _ = written(name)
    check_q8_0(model, f32, tmp_path, name)


def test_what_the_architectures_cannot_hold_is_refused_by_name(tmp_path):
    refused = functools.partial(check_refused, tmp_path)

    # The family list's own tiny Llama 4: chunks of 8, NoPE every second layer, floor 16.
    refused(
        "llama4",
        r"attention.chunk_size=8, attention.global_every=2, positions.nope_every=2, "
        r"attention.temperature_floor=16: GGUF architecture 'llama4' cannot hold it",
    )
    # llama.cpp normalises queries and keys in every Llama 4 but the one with 128 experts.
    unnormed = {**LLAMA_CPP, "attention": {**LLAMA_CPP["attention"], "qk_norm": None}}
    refused("llama4", "attention.qk_norm=None: GGUF architecture 'llama4'", **unnormed)
    refused("olmo3", r"positions.local_theta=500.0: GGUF architecture 'olmo2'")
    refused(
        "olmo3",
        "positions.scaling.kind='yarn'",
        positions={"local_theta": 10000.0},
    )
    refused("olmo2", "tie_embeddings=True: GGUF architecture 'olmo2'", tie_embeddings=True)
    assert not (tmp_path / "x.gguf").exists()


def test_a_llama4_file_llama_cpp_reads_otherwise_is_refused(written, tmp_path):
    """llama.cpp turns chunking off where `attention.sliding_window` is 0, and reads the window
    pattern from the file: eqllm's Llama 4 chunks every rotary layer, so both are refused by
    key; the window pattern written as llama.cpp's own (a period of 4) reads as without it."""
    model, _, _, reader, _ = written("llama4")
    pattern = "llama4.attention.sliding_window_pattern"
    _rewrite(reader, tmp_path / "4.gguf", "llama4", {pattern: 4})
    assert eqllm.hub.from_pretrained(tmp_path / "4.gguf").config == model.config
    for key, value in [("attention.sliding_window", 0), ("attention.sliding_window_pattern", 2)]:
        _rewrite(reader, tmp_path / f"{value}.gguf", "llama4", {f"llama4.{key}": value})
        with pytest.raises(CheckpointError, match=f"llama4.{key}={value}"):
            eqllm.hub.from_pretrained(tmp_path / f"{value}.gguf")


def test_an_olmo2_file_as_the_converter_writes_it_reads_back(written, tmp_path):
    """The converter writes `attention.key_length` only where config.json names head_dim (the
    published OLMo 2 files do not): without it the head is hidden_size / heads, as
    transformers' Olmo2 has it."""
    model, _, _, reader, _ = written("olmo2")
    left_out = {"olmo2.attention.key_length", "olmo2.attention.value_length"}
    _rewrite(reader, tmp_path / "c.gguf", "olmo2", {}, left_out)
    back = eqllm.hub.from_pretrained(tmp_path / "c.gguf")
    assert back.config == model.config.replace(scan_layers=back.config.scan_layers)


def test_llama4_with_128_experts_is_written_without_qk_norm(tmp_path):
    """llama.cpp normalises queries and keys in every Llama 4 but the one with 128 experts
    (use_kq_norm): such a model (Maverick's) is written without QK-norm and reads back without
    it, and the published Maverick's config is written; Scout's is refused for its Llama 3 rope
    scaling."""
    unnormed = {**LLAMA_CPP, "attention": {**LLAMA_CPP["attention"], "qk_norm": None}}
    model = _model("llama4-maverick", **unnormed, moe={"n_experts": 128})
    eqllm.hub.save_gguf(model, tmp_path / "m.gguf", type="f32")
    back = eqllm.hub.from_pretrained(tmp_path / "m.gguf")
    assert back.config == model.config and back.config.attention.qk_norm is None
    normed = model.config.replace(attention={"qk_norm": "l2"})
    with pytest.raises(eqllm.ConfigError, match="attention.qk_norm='l2': GGUF architecture"):
        check_exportable(normed, "f32")

    def published(name):
        return from_hf_config(json.loads((DATA / f"{name}.json").read_text()))

    check_exportable(published("llama4-maverick"), "f16")
    with pytest.raises(eqllm.ConfigError, match="positions.scaling.kind='llama3'"):
        check_exportable(published("llama4-scout"), "f16")
