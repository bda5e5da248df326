"""gpt-oss beyond the family contract (tests/test_families.py: logits both ways, cached decoding,
published counts): the family's settings read, not assumed (window, clamps, sinks), the exported
layout, the experts against transformers' on the same routing, the clamped SwiGLU, attention
sinks against a NumPy reference, MXFP4 experts dequantized as transformers does, the config.json
settings eqllm refuses, the families that refuse gpt-oss's settings on export, and the published
sizes' active parameters.

The model is tests/families.py's twin: a tiny random one built by transformers itself (no
downloads), every parameter perturbed.
"""

import json
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

import eqllm
from eqllm.nn import Attention
from eqllm.nn.attention import dot_product_attention
from eqllm.nn.moe import MoE, clamped_swiglu
from eqllm.train.step import training_loss
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gpt_oss_modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

WINDOW = 8  # tests/families.py's: far shorter than TOKENS (240), so the two kinds of layer differ


@pytest.fixture(scope="module")
def pair(twins):
    """The tiny gpt-oss of tests/families.py (grouped kv heads wider than d_model / n_heads, 4
    experts of 64, 2 per token, YaRN, a swiglu_limit small enough that the clamps bind), its
    saved folder and eqllm's import of it."""
    return twins("gpt_oss")


def test_import_reads_the_family(pair):
    cfg = pair.model.config
    assert cfg.family == "gpt_oss" and cfg.param_dtype == "float32"
    assert cfg.attention.sinks and cfg.attention.qkv_bias and cfg.attention.out_bias
    assert (cfg.attention.sliding_window, cfg.attention.global_every) == (WINDOW, 2)
    assert cfg.local_layers() == (True, False)  # layer 0 sliding, layer 1 full, as transformers
    assert hf_layer_types(pair.hf) == ["sliding_attention", "full_attention"]
    assert (cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.expert_d_ff) == (4, 2, 64)
    assert cfg.moe.bias and cfg.moe.activation == "clamped_swiglu"
    assert (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 0.5)
    assert cfg.positions.scaling.kind == "yarn" and cfg.positions.scaling.truncate is False
    assert cfg.attention.kernel == "auto" and pair.model.config.moe.aux_loss_coef == 0.1


def hf_layer_types(hf) -> list[str]:
    return [layer.self_attn.layer_type for layer in hf.model.layers]


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 2 * WINDOW},
        {"swiglu_limit": 7.0},
        {"swiglu_alpha": 1.0},
    ],
    ids=["window", "limit", "alpha"],
)
def test_the_settings_are_read_not_assumed(pair, tmp_path, change):
    """The same weights with another window, clamp or gain give logits off transformers'."""
    hf = json.loads((pair.folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    (tmp_path / "model.safetensors").symlink_to(pair.folder / "model.safetensors")
    changed = eqllm.hub.from_pretrained(tmp_path)
    assert np.abs(logits(changed, TOKENS) - pair.ref).max() > 1e-3


def test_the_sinks_matter(pair):
    """Zero sinks (still one more key scoring 0 in each denominator) move the logits."""
    zeroed = eqx.tree_at(
        lambda m: m.blocks.attn.sinks, pair.model, jnp.zeros_like(pair.model.blocks.attn.sinks)
    )
    assert np.abs(logits(zeroed, TOKENS[:64]) - pair.ref[:64]).max() > 1e-3


def test_export_writes_transformers_layout(pair, tmp_path):
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    # transformers' layout: experts fused as x @ W, gate and up interleaved.
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == [4, 32, 128]
    assert shapes["model.layers.1.mlp.experts.gate_up_proj_bias"] == [4, 128]
    assert shapes["model.layers.1.mlp.experts.down_proj"] == [4, 64, 32]
    assert shapes["model.layers.1.self_attn.sinks"] == [4]
    assert shapes["model.layers.0.mlp.router.bias"] == [4]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "full_attention"]
    assert (saved["swiglu_limit"], saved["sliding_window"]) == (0.5, WINDOW)


def test_experts_equal_transformers_experts_on_the_same_routing(pair):
    """One layer's mixture alone: eqllm's MoE (dense and ragged) equals GptOssMLP."""
    x = np.random.default_rng(3).normal(size=(30, 32)).astype(np.float32)
    with torch.no_grad():
        theirs = pair.hf.model.layers[0].mlp(torch.tensor(x)[None])[0][0].numpy()
    moe = jax.tree.map(lambda a: a[0], pair.model.blocks.mlp)
    assert isinstance(moe, MoE)
    for impl in ("dense", "ragged"):
        ours = np.asarray(moe.routed(jnp.asarray(x), impl)[0])
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_clamped_swiglu_is_gpt_oss_activation():
    gate_up = torch.linspace(-12, 12, 2 * 50).reshape(1, 100)
    experts = types.SimpleNamespace(alpha=1.702, limit=7.0)
    theirs = gpt_oss_modeling.GptOssExperts._apply_gate(experts, gate_up).numpy()
    g, u = gate_up.numpy()[..., ::2], gate_up.numpy()[..., 1::2]
    ours = np.asarray(clamped_swiglu(jnp.asarray(g), jnp.asarray(u), alpha=1.702, limit=7.0))
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)


# Attention sinks --------------------------------------------------------------------------------


def _numpy_sink_attention(q, k, v, mask, sinks, scale):
    """Per query head h: weights exp(s_j) / (sum_j exp(s_j) + exp(sink_h)), out = sum_j w_j v_j."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = np.zeros_like(q)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        scores = q[:, h] @ k[:, kh].T * scale
        scores = np.where(mask, scores, -np.inf)
        top = np.maximum(scores.max(-1, keepdims=True), sinks[h])
        e = np.exp(scores - top)
        out[:, h] = (e / (e.sum(-1, keepdims=True) + np.exp(sinks[h] - top))) @ v[:, kh]
    return out


def test_sink_attention_equals_the_closed_form():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(12, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(12, 2, 8)).astype(np.float32) for _ in range(2))
    sinks = rng.normal(size=4).astype(np.float32) * 2
    mask = np.tril(np.ones((12, 12), bool)) & ~np.tril(np.ones((12, 12), bool), -5)
    ours = dot_product_attention(*map(jnp.asarray, (q, k, v, mask)), sinks=jnp.asarray(sinks))
    expected = _numpy_sink_attention(q, k, v, mask, sinks, 8**-0.5)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-6, rtol=0)
    # A very negative sink takes no mass: plain softmax attention.
    none = dot_product_attention(*map(jnp.asarray, (q, k, v, mask)))
    drowned = dot_product_attention(*map(jnp.asarray, (q, k, v, mask)), sinks=jnp.full(4, -1e9))
    np.testing.assert_allclose(np.asarray(drowned), np.asarray(none), atol=1e-6, rtol=0)


def test_attention_layer_with_sinks_every_path_agrees():
    """In-order (default positions), explicit positions and the sink gradient."""
    attn = Attention(32, 4, n_kv_heads=2, sinks=True, sliding_window=5, key=jax.random.key(0))
    attn = eqx.tree_at(lambda a: a.sinks, attn, jnp.array([0.5, -1.0, 2.0, 0.0]))
    x = jax.random.normal(jax.random.key(1), (150, 32))
    in_order = attn(x)
    explicit = attn(x, jnp.arange(150))
    np.testing.assert_allclose(np.asarray(in_order), np.asarray(explicit), atol=1e-5, rtol=0)
    grad = jax.grad(lambda a: a(x).sum())(attn).sinks
    assert grad.shape == (4,) and np.all(np.abs(np.asarray(grad)) > 0)
    with pytest.raises(ValueError, match="no attention sinks"):
        Attention(32, 4, sinks=True, kernel="xla", key=jax.random.key(0))


def test_cudnn_is_refused_with_sinks_and_auto_falls_back():
    cfg = eqllm.zoo.config("gpt_oss-nano", compute_dtype="bfloat16")
    from eqllm.attention_backend import attention_kernel, cudnn_blockers

    assert "attention.sinks=True (the fused kernel has no sink logits)" in cudnn_blockers(
        cfg, "cuda", 256
    )
    assert attention_kernel(cfg) is None  # auto: the model's own attention
    with pytest.raises(eqllm.ConfigError, match="attention.sinks=True"):
        attention_kernel(cfg.replace(**{"attention.kernel": "cudnn"}))


# config.json settings -------------------------------------------------------------------------

PUBLISHED = {
    name: json.loads((Path(__file__).parent / "data" / "hf_configs" / f"{name}.json").read_text())
    for name in ("gpt-oss-20b", "gpt-oss-120b")
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types=.*sliding"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method='gptq'"),
        ({"experts_per_token": 2}, "experts_per_token=2 differs"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"sliding_window": None}, "must set 'sliding_window'"),
    ],
)
def test_settings_eqllm_cannot_express_are_refused(change, message):
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config({**PUBLISHED["gpt-oss-20b"], **change})


def _mxfp4(tensor: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks and scales shaped to stand for `tensor` [experts, in, out]."""
    experts, n_in, n_out = tensor.shape
    blocks = rng.integers(0, 256, (experts, n_out, n_in // 32, 16), dtype=np.uint8)
    scales = rng.integers(122, 130, (experts, n_out, n_in // 32), dtype=np.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_pair(pair, tmp_path_factory):
    """The tiny model's checkpoint with its experts as MXFP4 blocks and scales (as the published
    files store them), and the same checkpoint with transformers' dequantization of them."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    with safe_open(pair.folder / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(tensors[name], rng)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        theirs = mxfp4.convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        )
        dequantized[name] = theirs.numpy()
        assert dequantized[name].shape == tensors[name].shape
    hf = json.loads((pair.folder / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    folders = {}
    for kind, weights in (("mxfp4", quantized), ("dequantized", dequantized)):
        folder = folders[kind] = tmp_path_factory.mktemp(f"gpt-oss-{kind}")
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(hf))
    return folders


def test_mxfp4_experts_import_as_transformers_dequantizes_them(mxfp4_pair):
    quantized = eqllm.hub.from_pretrained(mxfp4_pair["mxfp4"])
    reference = eqllm.hub.from_pretrained(mxfp4_pair["dequantized"])
    gate = np.asarray(quantized.blocks.mlp.gate.weight)
    assert np.abs(gate).max() > 0 and len(np.unique(gate)) > 16  # values of many scales
    for a, b in zip(jax.tree.leaves(quantized), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mxfp4_blocks_that_do_not_fit_are_refused(mxfp4_pair, tmp_path):
    from safetensors.numpy import save_file

    with safe_open(mxfp4_pair["mxfp4"] / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][..., :1].copy()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((mxfp4_pair["mxfp4"] / "config.json").read_text())
    with pytest.raises(eqllm.hub.CheckpointError, match="MXFP4 blocks .* do not fit"):
        eqllm.hub.from_pretrained(tmp_path)


# The first case runs by default, the others in the slow set.
@pytest.mark.parametrize(
    "family, change",
    [
        ("llama-nano", {"attention.sinks": True}),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in (
                ("gemma2-nano", {"attention.sinks": True}),
                ("qwen3_moe-nano", {"attention.sinks": True}),
                ("qwen3_moe-nano", {"moe.bias": True}),
                (
                    "mixtral-nano",
                    {
                        "moe.activation": "clamped_swiglu",
                        "moe.swiglu_alpha": 1.7,
                        "moe.swiglu_limit": 7.0,
                    },
                ),
            )
        ),
    ],
)
def test_other_families_refuse_gpt_oss_settings_on_export(family, change, tmp_path):
    model = eqllm.CausalLM(eqllm.zoo.config(family, **change), key=jax.random.key(0))
    key = next(iter(change))
    with pytest.raises(eqllm.ConfigError, match=f"no Hugging Face equivalent.*{key}"):
        eqllm.hub.save_pretrained(model, tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"moe.activation": "clamped_swiglu"}, r"moe.swiglu_alpha=None must be set"),
        ({"moe.swiglu_limit": 7.0}, r"moe.swiglu_limit=7.0 is only read by"),
        ({"attention.sinks": "yes"}, r"attention.sinks='yes'"),
        ({"moe.activation": "gelu"}, r"moe.activation='gelu'"),
    ],
)
def test_config_validation_names_the_dotted_path(change, message):
    with pytest.raises(eqllm.ConfigError, match=f"ModelConfig.{message}"):
        eqllm.zoo.config("qwen3_moe-nano", **change)


# Published sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_total_and_active_parameters_equal_transformers(name):
    """Total: every parameter of transformers' model on the meta device. Active: that, less the
    routed experts a token does not reach, (n_experts - k) / n_experts of each layer's experts
    (their biases included)."""
    hf_config = transformers.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    count = sum(p.numel() for p in hf.parameters())
    experts = [layer.mlp.experts for layer in hf.model.layers]
    assert all(isinstance(e, gpt_oss_modeling.GptOssExperts) for e in experts)
    idle = sum(sum(p.numel() for p in e.parameters()) for e in experts)
    n, k = hf_config.num_local_experts, hf_config.num_experts_per_tok
    idle = idle * (n - k) // n
    assert eqllm.zoo.param_count(name) == count  # the published figure: tests/families.py
    assert eqllm.zoo.active_param_count(name) == count - idle
    cfg = eqllm.zoo.config(name)
    assert cfg == eqllm.hub.from_hf_config(PUBLISHED[name])


@pytest.mark.slow
def test_the_nano_trains_a_step_on_a_cpu():
    """gpt_oss-nano: the research size's loss falls over a few steps of its own batch."""
    model = eqllm.zoo.create("gpt_oss-nano", key=jax.random.key(0))
    assert model.config.attention.sinks and model.config.moe.activation == "clamped_swiglu"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (4, 33)), jnp.int32)
    optimizer = optax.adam(3e-3)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    @eqx.filter_jit
    def step(model, state):
        (loss, _), grads = eqx.filter_value_and_grad(training_loss, has_aux=True)(model, tokens)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(5):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5
