"""GGUF for Gemma 4 (tests/families.py's gemma4, gemma4-e, gemma4-moe and gemma4-plain-global:
global layers of their own shape with keys as values, E2B/E4B's per-layer inputs and kv-shared
layers with a double-wide MLP, 26B-A4B's experts, global layers shaped as the local ones) as
llama.cpp's convert_hf_to_gguf.py writes it (`Gemma4Model`).

The references: the gguf package's own tables (the gemma4 architecture's tensor names, its
metadata keys), the converter's renames and `rope_freqs` restated here from the Hugging Face
folder eqllm writes, and transformers' own GGUF loader, which reads gemma4 files with the gguf
package 0.19 (given the settings its gemma4 config map does not read from the file).
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import BY_NAME
from test_gguf_hybrid import (
    TOKENS,
    _array,
    _logits,
    _model,
    check_metadata,
    check_q8_0,
    f32_files,
)

import eqllm

gguf = pytest.importorskip("gguf")
if not hasattr(gguf.MODEL_ARCH, "GEMMA4"):
    pytest.skip("the gguf package defines gemma4 from 0.19 on", allow_module_level=True)
ARCH = "gemma4"
NAMES = ["gemma4", "gemma4-e", "gemma4-moe", "gemma4-plain-global"]
DEFAULT = ("gemma4", "gemma4-e")  # the others in the slow set
SLOW = [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return f32_files(tmp_path_factory)


def _layer(name: str) -> str:
    return name.split(".")[2]


def _expected_tensors(hf: dict, tensors: dict) -> dict[str, np.ndarray]:
    """llama.cpp's tensors from the Hugging Face ones, as the converter writes them: renamed by
    the gguf package's map after its own renames (`.weight` added to `layer_scalar` and the fused
    experts; the router's scales named by hand), no value changed (Gemma 4's norms scale by w),
    and the global layers' frequency factors."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, hf["num_hidden_layers"])
    out = {}
    for name, w in tensors.items():
        if name.endswith(".router.scale"):
            key = f"blk.{_layer(name)}.ffn_gate_inp.scale"
        elif name.endswith(".router.per_expert_scale"):
            key = f"blk.{_layer(name)}.ffn_down_exps.scale"
        else:
            fused = ".experts." in name and not name.endswith(".weight")
            renamed = name + ".weight" if fused or name.endswith("layer_scalar") else name
            key = names.get_name(renamed, try_suffixes=(".weight", ".bias"))
            assert key is not None, name
        out[key] = w
    full = hf["rope_parameters"]["full_attention"]
    half = hf["global_head_dim"] // 2
    turning = int(hf["global_head_dim"] * full.get("partial_rotary_factor", 1.0) / 2)
    out["rope_freqs.weight"] = np.array([1.0] * turning + [1e30] * (half - turning), np.float32)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_the_converters(written, name):
    model, hf, tensors, reader, _ = written(name)
    enum = gguf.MODEL_ARCH.GEMMA4
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) + suffix
        for t in gguf.MODEL_TENSORS[enum]
        for i in range(hf["num_hidden_layers"])
        for suffix in (".weight", ".bias", ".scale")
    }
    file = {t.name: _array(t) for t in reader.tensors}
    assert set(file) <= allowed
    expected = _expected_tensors(hf, tensors)
    assert set(file) == set(expected)
    for key, w in expected.items():
        np.testing.assert_array_equal(file[key], w, err_msg=key)
    # What the converter renames by hand, by the names llama.cpp loads.
    cfg = model.config
    hand = {"blk.0.layer_output_scale.weight", "rope_freqs.weight"}
    if cfg.moe is not None:
        hand |= {"blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"}
        hand |= {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_exps.weight"}
        hand |= {"blk.0.pre_ffw_norm_2.weight", "blk.0.post_ffw_norm_1.weight"}
    if cfg.per_layer is not None:
        hand |= {"per_layer_token_embd.weight", "per_layer_model_proj.weight"}
        hand |= {"per_layer_proj_norm.weight", "blk.0.inp_gate.weight", "blk.0.proj.weight"}
    assert hand <= set(file)
    # Keys as values: the global layers have no values of their own.
    global_layers = [i for i, t in enumerate(hf["layer_types"]) if t == "full_attention"]
    assert (f"blk.{global_layers[0]}.attn_v.weight" in file) == (not cfg.attention.k_eq_v)
    # kv-shared layers hold no keys or values.
    shared = range(cfg.n_layers - (cfg.attention.kv_shared_layers or 0), cfg.n_layers)
    assert not any(f"blk.{i}.attn_k.weight" in file for i in shared)


def _expected_metadata(hf: dict) -> dict:
    """The converter's metadata (TextModel, Gemma3Model, Gemma4Model), from config.json."""
    n, swa = hf["num_hidden_layers"], [t == "sliding_attention" for t in hf["layer_types"]]
    shared = hf["num_kv_shared_layers"]
    rope = hf["rope_parameters"]
    kv, global_kv = hf["num_key_value_heads"], hf["num_global_key_value_heads"]
    ff = hf["intermediate_size"]
    meta = {
        "block_count": n,
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "vocab_size": hf["vocab_size"],
        # Per layer where the layers differ (eqllm writes a scalar where they do not).
        "feed_forward_length": [ff] * (n - shared) + [2 * ff] * shared
        if hf["use_double_wide_mlp"]
        else ff,
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": kv if kv == global_kv else [kv if s else global_kv for s in swa],
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "attention.key_length": hf["global_head_dim"],
        "attention.value_length": hf["global_head_dim"],
        "attention.key_length_swa": hf["head_dim"],
        "attention.value_length_swa": hf["head_dim"],
        "rope.freq_base": rope["full_attention"]["rope_theta"],
        "rope.freq_base_swa": rope["sliding_attention"]["rope_theta"],
        "rope.dimension_count": hf["global_head_dim"],
        "rope.dimension_count_swa": hf["head_dim"],
        "attention.sliding_window": hf["sliding_window"],
        "attention.sliding_window_pattern": swa,
        "attention.shared_kv_layers": shared,
        "embedding_length_per_layer_input": hf["hidden_size_per_layer_input"],
    }
    if hf["final_logit_softcapping"]:
        meta["final_logit_softcapping"] = hf["final_logit_softcapping"]
    if hf["enable_moe_block"]:
        meta["expert_count"] = hf["num_experts"]
        meta["expert_used_count"] = hf["top_k_experts"]
        meta["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    return meta


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_llama_cpps(written, name):
    _, hf, _, reader, _ = written(name)
    expected = _expected_metadata(hf)
    check_metadata(reader, ARCH, expected)
    written_keys = {k for k in reader.fields if k.startswith(f"{ARCH}.")}
    assert written_keys == {f"{ARCH}.{k}" for k in expected}


@pytest.mark.parametrize("name", SLOW)
def test_round_trip_gives_the_same_model(written, name):
    """Read back: the same config, every weight bit for bit (the file holds them unchanged)."""
    model, _, _, _, tmp = written(name)
    back = eqllm.hub.from_pretrained(tmp / "m.gguf")
    # scan_layers is how the stack runs (from_pretrained's default), not what it computes.
    assert back.config == model.config.replace(scan_layers=back.config.scan_layers)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    # Against the folder the file was written from, read the same way (scanned and unrolled
    # runs differ by fp32 rounding, 3e-5 here).
    ours = _logits(eqllm.hub.from_pretrained(tmp / "hf"))
    np.testing.assert_allclose(_logits(back), ours, rtol=0, atol=1e-5 * np.abs(ours).max())


@pytest.mark.parametrize("name", ["gemma4-e", pytest.param("gemma4-moe", marks=pytest.mark.slow)])
def test_q8_0_keeps_llama_cpps_f32_tensors(name, tmp_path):
    """Q8_0 quantizes the 2-D weights and the experts; norms, vectors (`layer_output_scale`,
    the scales, `rope_freqs`) and the router stay F32; rows not a multiple of 32 long, F16.
    The q/k norms are drawn at a quarter of the shared model's: Gemma 4's scores are unscaled,
    and with unit QK-norm weights the tiny random model turns its weights' rounding into ~100x
    larger logit changes (f16: 0.07 of the largest logit; 7e-4 with these)."""
    qk = ("q_norm", "k_norm")
    model = jax.tree_util.tree_map_with_path(
        lambda p, w: w / 4 if any(n in jax.tree_util.keystr(p) for n in qk) else w, _model(name)
    )
    eqllm.hub.save_gguf(model, tmp_path / "m.gguf", type="f32")
    check_q8_0(model, gguf.GGUFReader(str(tmp_path / "m.gguf")), tmp_path, name)


def test_what_gemma4_cannot_hold_is_refused_by_name(tmp_path):
    def refused(match, **overrides):
        config = BY_NAME["gemma4-e"].config.replace(**overrides)
        model = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
        with pytest.raises(eqllm.ConfigError, match=match) as error:
            eqllm.hub.save_gguf(model, tmp_path / "x.gguf")
        assert "\n" not in str(error.value)

    refused(r"per_layer.vocab_size=128: GGUF architecture 'gemma4'", per_layer={"vocab_size": 128})
    refused(r"positions.global_fraction=0.3: GGUF", positions={"global_fraction": 0.3})
    assert not (tmp_path / "x.gguf").exists()


# transformers' GGUF loader ------------------------------------------------------------------

# What transformers' loader (5.25) leaves at its initial values: its name map looks up the
# tensors the converter renames by hand without their `.weight` and `.scale` suffixes.
UNREAD = ("layer_scalar",)
UNREAD_EXPERTS = ("experts.gate_up_proj", "experts.down_proj", "router.scale")
UNREAD_EXPERTS += ("router.per_expert_scale",)


def _transformers_reads(tmp, hf: dict):
    """transformers' model of the file `tmp`/m.gguf through its GGUF loader, and what it did
    not load: the config from the settings its gemma4 map reads from the file (checked against
    eqllm's config.json first) and, from config.json, those it does not read or reads as lists
    (llama.cpp's per-layer `attention.head_count_kv` and `feed_forward_length`)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    mapped = {v for v in GGUF_CONFIG_MAPPING[ARCH].values() if v is not None}
    parsed = load_gguf_checkpoint(str(tmp / "m.gguf"))["config"]
    read = {k: v for k, v in parsed.items() if k in mapped and not isinstance(v, list)}
    for key, value in read.items():
        assert value == pytest.approx(hf[key], rel=1e-7), key
    meta = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype"}
    given = {k: v for k, v in hf.items() if k not in read and k not in meta}
    config = transformers.AutoConfig.for_model("gemma4_text", **given, **read)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp), gguf_file="m.gguf", config=config, dtype=torch.float32, output_loading_info=True
    )
    lists = sorted(k for k in mapped & set(parsed) if isinstance(parsed[k], list))
    return model.eval(), set(info["missing_keys"]), lists


@pytest.mark.parametrize("name", SLOW)
def test_transformers_gguf_loader_gives_eqllms_logits(name, tmp_path):
    """transformers' GGUF loader reads eqllm's file as eqllm's model (within 1e-4 of the
    largest logit), but for the layer scalars, which it leaves at 1 (the model drawn with them
    at 1 here), and 26B-A4B's experts, router scale and per-expert scales, which it does not
    load at all (compared by name only)."""
    torch = pytest.importorskip("torch")
    model = jax.tree_util.tree_map_with_path(
        lambda p, w: jnp.ones_like(w) if "layer_scalar" in jax.tree_util.keystr(p) else w,
        _model(name),
    )
    eqllm.hub.save_pretrained(model, tmp_path / "hf", dtype="float32")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    eqllm.hub.save_gguf(model, tmp_path / "m.gguf", type="f32")
    theirs, missing, lists = _transformers_reads(tmp_path, hf)
    cfg = model.config
    unread = UNREAD + (UNREAD_EXPERTS if cfg.moe is not None else ())
    assert missing == {f"model.layers.{i}.{n}" for i in range(cfg.n_layers) for n in unread}
    # The keys it reads as lists, where llama.cpp's per-layer arrays stand.
    assert (
        lists
        == {
            "gemma4": ["num_key_value_heads"],
            "gemma4-moe": ["num_key_value_heads"],
            "gemma4-e": ["intermediate_size"],
            "gemma4-plain-global": [],
        }[name]
    )
    if cfg.moe is not None:
        return
    with torch.no_grad():
        got = theirs(torch.tensor(TOKENS)[None]).logits[0].numpy()
    ours = _logits(model)
    error = np.abs(got - ours).max() / np.abs(ours).max()
    print(f"{name}: transformers' GGUF loader, largest logit difference {error:.2g}")
    assert error <= 1e-4


def _metadata_only(cfg, tmp_path):
    """(hf config.json, field, stored) of a file of `cfg` as eqllm writes it without the weights:
    its metadata, and tensors of no width under the names the file would hold."""
    from eqllm.hub.gguf import hf_tensor_names
    from eqllm.hub.gguf_gemma4 import _names, _target, rope_freqs, write_gemma4

    hf = eqllm.hub.to_hf_config(cfg)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), ARCH)
    write_gemma4(writer, gguf, hf, {}, None, lambda *a: a)  # metadata and rope_freqs only
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields

    def field(key, default=None):
        return fields[key].contents() if key in fields else default

    names = _names(gguf, cfg.n_layers)
    stored = {_target(gguf, names, n)[1]: np.zeros((0,)) for n in hf_tensor_names(cfg)}
    stored["token_embd.weight"] = np.zeros((cfg.vocab_size, 0))
    if cfg.per_layer is not None:
        stored["per_layer_token_embd.weight"] = np.zeros((cfg.vocab_size, 0))
    stored["rope_freqs.weight"] = rope_freqs(hf)
    return hf, field, stored


@pytest.mark.parametrize("size", ["gemma4-31b", "gemma4-26b-a4b", "gemma4-e2b", "gemma4-e4b"])
def test_published_sizes_read_back_from_their_metadata(size, tmp_path):
    """Each published size's metadata, as eqllm writes it, reads back as the same config; the
    per-layer arrays stand where the layers differ (31B and 26B-A4B's global kv heads, E2B's
    double-wide MLP), as the converter writes them for these releases."""
    from eqllm.hub.gguf_gemma4 import _config

    cfg = eqllm.zoo.config(size)
    hf, field, stored = _metadata_only(cfg, tmp_path)
    config = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    back = eqllm.hub.from_hf_config({**config, **_config(field, stored, "m.gguf")})
    assert back == cfg
    expected = _expected_metadata(hf)
    expected.pop("vocab_size")  # eqllm.hub.gguf's, written for every architecture
    for key, value in expected.items():
        assert field(f"{ARCH}.{key}") == pytest.approx(value, rel=1e-7), key
    kv = field(f"{ARCH}.attention.head_count_kv")
    ff = field(f"{ARCH}.feed_forward_length")
    assert isinstance(kv, list) == (cfg.attention.global_kv_heads is not None)
    assert isinstance(ff, list) == (cfg.mlp.kv_shared_d_ff is not None)


def test_what_eqllm_cannot_read_is_refused_by_name(tmp_path):
    """A Gemma 4 file whose frequency factors are not proportional RoPE's, or whose per-layer
    kv heads differ within a layer type, is refused naming the key."""
    from eqllm.hub.files import CheckpointError
    from eqllm.hub.gguf_gemma4 import _config

    _, field, stored = _metadata_only(eqllm.zoo.config("gemma4-31b"), tmp_path)
    factors = stored["rope_freqs.weight"].copy()
    factors[1] = 0.5
    with pytest.raises(CheckpointError, match="rope_freqs holds factors other than"):
        _config(field, {**stored, "rope_freqs.weight": factors}, "m.gguf")
    kv = field(f"{ARCH}.attention.head_count_kv")
    uneven = {f"{ARCH}.attention.head_count_kv": [kv[0] + 1, *kv[1:]]}
    with pytest.raises(CheckpointError, match=f"{ARCH}.attention.head_count_kv="):
        _config(lambda k, d=None: uneven.get(k, field(k, d)), stored, "m.gguf")


def test_gemma4_vocabulary_reads_as_transformers_reads_it(tmp_path):
    """llama.cpp's "gemma4" vocabulary (the converter writes Gemma 4's tokenizer.json tokens and
    merges so) reads as transformers builds it from the same file (its GemmaTokenizer): the same
    ids for text with spaces, newlines, bytes outside the vocabulary, control and user-defined
    tokens, and the same text back."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    from eqllm.hub.gguf_vocab import read_tokenizer

    T = gguf.TokenType
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    pieces = "▁ h e l o w r d he ll llo hello ▁hello ▁w or ▁wor ld ▁world".split()
    tokens = [*specials, "<|tool_call>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [T.CONTROL] * 3 + [T.UNKNOWN, T.CONTROL, T.USER_DEFINED] + [T.BYTE] * 256
    types += [T.NORMAL] * len(pieces)
    merges = ["h e", "l l", "ll o", "he llo", "▁ hello", "▁ w", "o r", "▁w or", "l d", "▁wor ld"]
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), ARCH)
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = gguf.GGUFReader(str(tmp_path / "v.gguf")).fields
    ours = read_tokenizer(lambda k, d=None: fields[k].contents() if k in fields else d, "v.gguf")
    arch, vocab, _ = get_gguf_tokenizer(str(tmp_path / "v.gguf"))
    theirs, _ = convert_gguf_tokenizer(arch, vocab)
    texts = ["hello world", " hello  world", "hello\nworld", "héllo wörld ✓"]
    texts += ["<start_of_turn>hello", "a <|tool_call> world", "<bos>hello<eos>"]
    for text in texts:
        ids = ours.encode_with_specials(text)  # special tokens matched, as transformers does
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.hf.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False
        )
    assert ours.encode("hello world") == [tokens.index("hello"), tokens.index("▁world")]
    assert ours.eot_id == 1
