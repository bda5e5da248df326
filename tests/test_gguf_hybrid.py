"""GGUF for the hybrid and state-space families (qwen3_5, qwen3_5_moe, qwen3_next, mamba2,
falcon_h1) as llama.cpp's convert_hf_to_gguf.py writes them.

transformers' GGUF loader reads none of these architectures, so the references are the gguf
package's own tables (tensor names per architecture, metadata keys) and the converter's
transforms, restated here index by index from the Hugging Face folder eqllm writes (not with
the reshapes eqllm's writer uses): -exp(A_log), 1 + w norms, Qwen3-Next's split of
in_proj_qkvz, Qwen3.5's tiled value heads, stacked experts, Falcon-H1's folded multipliers.
"""

import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import BY_NAME
from safetensors.numpy import load_file

import eqllm

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
NAMES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "mamba2", "falcon_h1"]
ARCH = {
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_next": "qwen3next",
    "mamba2": "mamba2",
    "falcon_h1": "falcon-h1",
}
TOKENS = np.random.default_rng(0).integers(0, 97, 48)


def _model(name, **overrides):
    """The family list's tiny model (its config replaced by `overrides`) with random weights
    drawn on the host (no initialisation to compile): N(0, 0.05) everywhere, 1 + N(0, 0.05) for
    norms, so that no transform can pass by acting on zeros or ones."""
    config = BY_NAME[name].config.replace(**overrides)
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(base + 0.05 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return f32_files(tmp_path_factory)


def f32_files(tmp_path_factory, overrides=None):
    """name -> (model, HF config.json, HF tensors, GGUF reader, folder) of the family's f32
    file (its config changed by `overrides[name]`), each written once (a `written` fixture)."""
    cache = {}

    def get(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            model = _model(name, **(overrides or {}).get(name, {}))
            eqllm.hub.save_pretrained(model, tmp / "hf", dtype="float32")
            hf = json.loads((tmp / "hf" / "config.json").read_text())
            tensors = {}
            for f in (tmp / "hf").glob("*.safetensors"):
                tensors |= load_file(str(f))
            eqllm.hub.save_gguf(model, tmp / "m.gguf", type="f32")
            cache[name] = (model, hf, tensors, gguf.GGUFReader(str(tmp / "m.gguf")), tmp)
        return cache[name]

    return get


def _logits(model, tokens=TOKENS):
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(tokens)))


def _array(t):
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(int(n) for n in reversed(t.shape))
    )


# tests/test_families.py reads every family's file back by default; here the configs too, the
# state-space model by default (compiling the Gated DeltaNet hybrids twice is slow).
@pytest.mark.parametrize(
    "name", [n if n == "mamba2" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]
)
def test_round_trip_gives_the_same_logits_and_config(written, name):
    model, _, _, _, tmp = written(name)
    back = eqllm.hub.from_pretrained(tmp / "m.gguf")
    # What a GGUF file does not hold: Mamba-2's chunk length (a schedule, not the function),
    # Falcon-H1's multipliers (folded into the weights, as llama.cpp's converter folds them).
    lost = {"linear": {"chunk_size": back.config.linear.chunk_size}, "multipliers": None}
    assert back.config == model.config.replace(**lost)
    if model.config.multipliers is None:
        # Every weight comes back to within float32 rounding of 1 + w and -exp(A_log).
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=3e-7)
    # That rounding, run through the recurrence over 48 tokens, stays under 1e-5 of the
    # largest logit.
    ours = _logits(model)
    np.testing.assert_allclose(_logits(back), ours, rtol=0, atol=1e-5 * np.abs(ours).max())


def _tiled(nk, nv, dim):
    """Row order of llama.cpp's tiled value heads: row block p holds grouped head g * r + j for
    p = j * nk + g (value head j of key head g), each `dim` rows."""
    r = nv // nk
    heads = [g * r + j for j in range(r) for g in range(nk)]
    return np.concatenate([np.arange(h * dim, (h + 1) * dim) for h in heads])


def _expected_gdn(arch, hf, tensors):
    """llama.cpp's tensors of a Gated DeltaNet hybrid, from the Hugging Face tensors."""
    nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    tile = arch != "qwen3next" and nk != nv
    v_rows = _tiled(nk, nv, dv) if tile else np.arange(nv * dv)
    head_rows = _tiled(nk, nv, 1) if tile else np.arange(nv)
    qk = 2 * nk * dk
    out = {}
    for name, w in tensors.items():
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        blk = f"blk.{i}." if i is not None else ""
        short = name.removeprefix(f"model.layers.{i}.") if i is not None else name
        if short.startswith("mlp.experts."):
            j, what = short.split(".")[2:4]
            key = f"{blk}ffn_{what.removesuffix('_proj')}_exps.weight"
            out.setdefault(key, {})[int(j)] = w
            continue
        if short == "linear_attn.A_log":
            out[blk + "ssm_a"] = -np.exp(w[head_rows])
        elif short == "linear_attn.dt_bias":
            out[blk + "ssm_dt.bias"] = w[head_rows]
        elif short == "linear_attn.conv1d.weight":
            out[blk + "ssm_conv1d.weight"] = w[np.r_[np.arange(qk), qk + v_rows], 0]
        elif short == "linear_attn.in_proj_qkv.weight":
            out[blk + "attn_qkv.weight"] = w[np.r_[np.arange(qk), qk + v_rows]]
        elif short == "linear_attn.in_proj_z.weight":
            out[blk + "attn_gate.weight"] = w[v_rows]
        elif short in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
            kind = "beta" if "_b." in short else "alpha"
            out[f"{blk}ssm_{kind}.weight"] = w[head_rows]
        elif short == "linear_attn.in_proj_qkvz.weight":
            # Per key head g: q, k, then its r value heads' v and z rows.
            r, per = nv // nk, 2 * dk + 2 * nv // nk * dv
            rows = {p: [] for p in "qkvz"}
            for g in range(nk):
                base = g * per
                rows["q"] += range(base, base + dk)
                rows["k"] += range(base + dk, base + 2 * dk)
                rows["v"] += range(base + 2 * dk, base + 2 * dk + r * dv)
                rows["z"] += range(base + 2 * dk + r * dv, base + per)
            out[blk + "attn_qkv.weight"] = w[rows["q"] + rows["k"] + rows["v"]]
            out[blk + "attn_gate.weight"] = w[rows["z"]]
        elif short == "linear_attn.in_proj_ba.weight":
            out[blk + "ssm_ba.weight"] = w
        elif short == "linear_attn.out_proj.weight":
            out[blk + "ssm_out.weight"] = w[:, v_rows]
        elif short == "linear_attn.norm.weight":
            out[blk + "ssm_norm.weight"] = w  # scales by w: no offset
        else:
            gguf_name = _mapped(arch, hf, name)
            out[gguf_name] = w + 1 if name.endswith("norm.weight") else w
    for key, experts in out.items():
        if isinstance(experts, dict):
            out[key] = np.stack([experts[j] for j in range(len(experts))])
    return out


def _mapped(arch, hf, name):
    """The gguf package's llama.cpp name for a Hugging Face tensor name."""
    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    found = gguf.get_tensor_name_map(enum, hf["num_hidden_layers"]).get_name(
        name, try_suffixes=(".weight", ".bias")
    )
    assert found is not None, name
    return found


def _expected_mamba(arch, hf, tensors):
    """llama.cpp's tensors of Mamba-2 or Falcon-H1, from the Hugging Face tensors."""
    falcon = arch == "falcon-h1"
    inner = hf["mamba_d_ssm"] if falcon else hf["num_heads"] * hf["head_dim"]
    groups = hf["mamba_n_groups"] if falcon else hf["n_groups"]
    state = hf["mamba_d_state"] if falcon else hf["state_size"]
    out = {}
    for name, w in tensors.items():
        key = _mapped(arch, hf, name.replace(".dt_bias", ".dt_proj.bias"))
        if name.endswith(".A_log"):
            w = -np.exp(w)[:, None]
        elif name.endswith(".D"):
            w = w[:, None]
        elif name.endswith("conv1d.weight"):
            w = w[:, 0, :]
        elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
            w = w.reshape(groups, -1)
        if falcon:
            w = w * _falcon_factor(hf, name, inner, groups * state, w.shape)
        out[key] = w
    return out


def _falcon_factor(hf, name, inner, gs, shape):
    """Falcon-H1's multiplier of one tensor (per row for in_proj: z, x, B, C, dt)."""
    m = lambda k: hf.get(k, 1.0)  # noqa: E731
    gate, down = hf.get("mlp_multipliers", (1.0, 1.0))
    if name.endswith("mamba.in_proj.weight"):
        sizes = [inner, inner, gs, gs, shape[0] - 2 * inner - 2 * gs]
        ssm = hf.get("ssm_multipliers", (1.0,) * 5)
        per_row = np.concatenate([np.full(n, s) for n, s in zip(sizes, ssm, strict=True)])
        return m("ssm_in_multiplier") * per_row[:, None]
    factors = {
        "feed_forward.gate_proj": gate,
        "feed_forward.down_proj": down,
        "self_attn.q_proj": m("attention_in_multiplier"),
        "self_attn.k_proj": m("attention_in_multiplier") * m("key_multiplier"),
        "self_attn.v_proj": m("attention_in_multiplier"),
        "self_attn.o_proj": m("attention_out_multiplier"),
        "mamba.out_proj": m("ssm_out_multiplier"),
        "lm_head": m("lm_head_multiplier"),
        "embed_tokens": m("embedding_multiplier"),
    }
    return next((f for part, f in factors.items() if f"{part}.weight" in name), 1.0)


@pytest.mark.parametrize("name", NAMES)
def test_tensors_are_llama_cpps(written, name):
    """Every tensor is one of the architecture's in the gguf package's table (MODEL_TENSORS),
    and equals the converter's transform of the Hugging Face tensor."""
    _, hf, tensors, reader, _ = written(name)
    arch = ARCH[name]
    make = _expected_mamba if name in ("mamba2", "falcon_h1") else _expected_gdn
    expected = make(arch, hf, tensors)
    check_tensors(reader, arch, hf["num_hidden_layers"], expected, rtol=1e-6)


def check_tensors(reader, arch: str, layers: int, expected: dict, rtol: float = 0.0) -> dict:
    """The file `reader` reads is llama.cpp's `arch`, every tensor one of the architecture's in
    the gguf package's table (MODEL_TENSORS) for `layers` blocks, and it holds exactly
    `expected` (name -> the converter's transform of the Hugging Face tensor), each equal within
    `rtol`. Returns the file's tensors."""
    assert reader.fields["general.architecture"].contents() == arch
    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) + suffix
        for t in gguf.MODEL_TENSORS[enum]
        for i in range(layers)
        for suffix in ("", ".weight", ".bias")
    }
    file = {t.name: _array(t) for t in reader.tensors}
    assert set(file) <= allowed
    assert set(file) == set(expected)
    for key, w in expected.items():
        np.testing.assert_allclose(file[key], w, rtol=rtol, atol=0, err_msg=key)
    return file


def _expected_metadata(name, hf):
    """The converter's metadata (TextModel, Qwen2Moe, Qwen3Next, Mamba2, FalconH1 models)."""
    if name in ("mamba2", "falcon_h1"):
        falcon = name == "falcon_h1"
        inner = hf["mamba_d_ssm"] if falcon else hf["num_heads"] * hf["head_dim"]
        heads = hf["mamba_n_heads"] if falcon else hf["num_heads"]
        meta = {
            "ssm.conv_kernel": hf["mamba_d_conv" if falcon else "conv_kernel"],
            "ssm.inner_size": inner,
            "ssm.state_size": hf["mamba_d_state" if falcon else "state_size"],
            "ssm.time_step_rank": heads,
            "ssm.group_count": hf["mamba_n_groups" if falcon else "n_groups"],
            "embedding_length": hf["hidden_size"],
            "feed_forward_length": hf["intermediate_size"] if falcon else 0,
            "attention.head_count": hf["num_attention_heads"] if falcon else 0,
        }
        if falcon:
            meta |= {
                "attention.head_count_kv": hf["num_key_value_heads"],
                "attention.key_length": hf["head_dim"],
                "rope.freq_base": hf["rope_theta"],
            }
        return meta
    rope = hf["rope_parameters"]
    meta = {
        "ssm.conv_kernel": hf["linear_conv_kernel_dim"],
        "ssm.state_size": hf["linear_key_head_dim"],
        "ssm.group_count": hf["linear_num_key_heads"],
        "ssm.time_step_rank": hf["linear_num_value_heads"],
        "ssm.inner_size": hf["linear_value_head_dim"] * hf["linear_num_value_heads"],
        "full_attention_interval": hf["layer_types"].index("full_attention") + 1,
        "rope.dimension_count": int(hf["head_dim"] * rope["partial_rotary_factor"]),
        "rope.freq_base": rope["rope_theta"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.key_length": hf["head_dim"],
    }
    if "num_experts" in hf:
        meta |= {
            "expert_count": hf["num_experts"],
            "expert_used_count": hf["num_experts_per_tok"],
            "expert_feed_forward_length": hf["moe_intermediate_size"],
            "expert_shared_feed_forward_length": hf["shared_expert_intermediate_size"],
        }
    if name != "qwen3_next":
        meta["rope.dimension_sections"] = [11, 11, 10, 0]
    return meta


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_llama_cpps(written, name):
    _, hf, _, reader, _ = written(name)
    check_metadata(reader, ARCH[name], _expected_metadata(name, hf))


def check_metadata(reader, arch: str, expected: dict) -> None:
    """Every key of `expected` is one the gguf package names (gguf.Keys) and `reader`'s file
    holds it under `arch` with the converter's value (floats within 1e-7, the rest exactly)."""
    keys = {k.replace("{arch}", arch) for k in _package_keys()}
    for key, value in expected.items():
        assert f"{arch}.{key}" in keys, key
        got = reader.fields[f"{arch}.{key}"].contents()
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-7), key
        else:
            assert got == value, key


def _package_keys():
    keys = []
    for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.SSM):
        keys += [v for k, v in vars(group).items() if k.isupper() and isinstance(v, str)]
    return keys


@pytest.mark.parametrize("name", ["falcon_h1", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_q8_0_keeps_llama_cpps_f32_tensors(written, name, tmp_path):
    """Q8_0 quantizes the 2-D weights, each within its block's rounding of the f32 file's;
    norms, vectors, the conv1d kernel, the routers and names without `.weight` (ssm_a, ssm_d)
    stay F32 as the converter keeps them; rows Q8_0's blocks of 32 do not divide, F16."""
    model, _, _, f32, _ = written(name)
    check_q8_0(model, f32, tmp_path, name)


def check_q8_0(model, f32, tmp_path, name: str) -> None:
    """`model` written as Q8_0 against its f32 file `f32` (a GGUFReader): each tensor's type as
    llama.cpp's converter keeps it, within its block's rounding, and the logits read back."""
    eqllm.hub.save_gguf(model, tmp_path / "q.gguf", type="q8_0")
    exact = {t.name: _array(t) for t in f32.tensors}
    for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors:
        f32_kept = (
            len(t.shape) < 2
            or not t.name.endswith(".weight")
            or t.name.endswith("_norm.weight")
            or any(p in t.name for p in ("ssm_conv1d", "ffn_gate_inp"))
        )
        quantized = T.Q8_0 if int(t.shape[0]) % 32 == 0 else T.F16
        assert t.tensor_type == (T.F32 if f32_kept else quantized), t.name
        scale = np.abs(exact[t.name]).max(axis=-1, keepdims=True)
        bound = {T.F32: 0.0, T.F16: 1e-3, T.Q8_0: 1 / 254 + 1e-3}[t.tensor_type] * scale
        assert (np.abs(_array(t) - exact[t.name]) <= bound).all(), t.name
    back = eqllm.hub.from_pretrained(tmp_path / "q.gguf")
    ours = _logits(model)
    error = np.abs(_logits(back) - ours).max() / np.abs(ours).max()
    print(f"{name} q8_0: largest logit difference {error:.2g} of the largest logit")
    # Random tiny weights through the recurrences: up to ~0.17 measured (docs/hub.md).
    assert error <= 0.25


def check_refused(tmp_path, name, match, **overrides):
    """Writing the family list's `name` with `overrides` as GGUF is refused in one line that
    matches `match`."""
    config = BY_NAME[name].config.replace(**overrides)
    model = eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))
    with pytest.raises(eqllm.ConfigError, match=match) as error:
        eqllm.hub.save_gguf(model, tmp_path / "x.gguf")
    assert "\n" not in str(error.value)


def test_what_an_architecture_cannot_hold_is_refused_by_name(tmp_path):
    refused = functools.partial(check_refused, tmp_path)

    refused("olmo_hybrid", "olmo_hybrid model has no GGUF architecture")
    refused("mamba2_untied", r"linear.dt_min=0.01, linear.dt_max=0.1: GGUF architecture 'mamba2'")
    refused("falcon_h1_normed", "linear.gate_norm='before_gate'.*'falcon-h1'")
    refused(
        "qwen3_next",
        "moe.norm_topk_prob=False: GGUF architecture 'qwen3next'",
        moe={"norm_topk_prob": False},
    )
    refused(
        "qwen3_5",
        "linear.value_head_dim=16: GGUF architecture 'qwen35'",
        linear={"value_head_dim": 16},
    )
    assert not (tmp_path / "x.gguf").exists()


def test_multi_token_prediction_layers_are_left_out(written, tmp_path):
    """llama.cpp's Qwen3.5 files count their multi-token-prediction layers in block_count
    (`nextn_predict_layers`) and hold them as further blocks: read as the model without them,
    as eqllm's Hugging Face import leaves `mtp.*` out."""
    model, hf, _, reader, tmp = written("qwen3_5")
    n = hf["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(tmp_path / "mtp.gguf"), "qwen35")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents() + 1 if key == "qwen35.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    writer.add_uint32("qwen35.nextn_predict_layers", 1)
    for t in reader.tensors:
        writer.add_tensor(t.name, _array(t))
    d = hf["hidden_size"]
    writer.add_tensor(f"blk.{n}.nextn.eh_proj.weight", np.ones((d, 2 * d), np.float32))
    writer.add_tensor(f"blk.{n}.attn_norm.weight", np.ones(d, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back = eqllm.hub.from_pretrained(tmp_path / "mtp.gguf")
    assert back.config == eqllm.hub.from_pretrained(tmp / "m.gguf").config
    assert back.config.n_layers == n
