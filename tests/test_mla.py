"""Multi-head latent attention and DeepSeek's routing against transformers' own modules
(DeepseekV3Attention / DeepseekV2Attention, DeepseekV3MoE / DeepseekV2Moe) on the same weights,
with and without query compression, interleaved and half rotation, YaRN's mscale, group-limited
routing and the correction bias; cached decoding from the latents (absorbed and expanded)
against the full forward; the latent cache's size against grouped-query attention's."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.nn import KVCache, RopeScaling, RotaryEmbedding
from eqllm.nn.mla import LatentCache, MultiHeadLatentAttention
from eqllm.nn.moe import MoE

torch = pytest.importorskip("torch")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402

D, HEADS, SEQ = 32, 4, 40
MLA_DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


@eqx.filter_jit
def _call(module, x, *args):
    return module(x, *args)


def _t(a):
    return torch.tensor(np.asarray(a))


def _n(t):
    return t.detach().numpy()


def _v3_config(**changes):
    spec = dict(
        vocab_size=50,
        hidden_size=D,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=1,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        q_lora_rank=16,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MLA_DIMS,
    )
    spec.update(changes)
    cfg = DeepseekV3Config(**spec)
    cfg._attn_implementation = "eager"
    return cfg


def _perturbed(module, seed):
    """Every weight drawn anew (fused experts start as torch.empty: any bits), norms near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if p.dtype.is_floating_point:
                noise = 0.3 * torch.randn(p.shape, generator=g)
                p.copy_(1 + noise if "norm" in name else noise)
    return module


def _scaling(rope_parameters):
    if rope_parameters["rope_type"] == "default":
        return None
    p = rope_parameters
    return RopeScaling(
        "yarn",
        factor=p["factor"],
        original_max_seq_len=p["original_max_position_embeddings"],
        beta_fast=p["beta_fast"],
        beta_slow=p["beta_slow"],
        mscale=p["mscale"],
        mscale_all_dim=p["mscale_all_dim"],
    )


def _mla_from(theirs, cfg, interleaved, mscale=True, absorb=True):
    """An eqllm MLA with the weights of transformers' attention module `theirs`."""
    p = cfg.rope_parameters
    scaling = _scaling(p)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if scaling is not None and mscale:  # transformers' yarn_apply_mscale, spelled out
        m = 0.1 * scaling.mscale_all_dim * np.log(scaling.factor) + 1.0
        scale = float(scale * m * m)
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, p["rope_theta"], scaling=scaling)
    ours = MultiHeadLatentAttention(
        D,
        HEADS,
        **MLA_DIMS,
        q_lora_rank=cfg.q_lora_rank,
        rope=rope,
        interleaved=interleaved,
        scale=scale,
        absorb=absorb,
        key=jax.random.key(0),
    )
    w = {k: jnp.asarray(_n(v)) for k, v in theirs.state_dict().items()}
    if cfg.q_lora_rank is None:
        ours = _set(ours, "q_proj.weight", w["q_proj.weight"])
    else:
        ours = _set(ours, "q_a_proj.weight", w["q_a_proj.weight"])
        ours = _set(ours, "q_a_norm.weight", w["q_a_layernorm.weight"])
        ours = _set(ours, "q_b_proj.weight", w["q_b_proj.weight"])
    for mine, hf in [
        ("kv_a_proj.weight", "kv_a_proj_with_mqa.weight"),
        ("kv_a_norm.weight", "kv_a_layernorm.weight"),
        ("kv_b_proj.weight", "kv_b_proj.weight"),
        ("o_proj.weight", "o_proj.weight"),
    ]:
        ours = _set(ours, mine, w[hf])
    return ours


def _set(module, path, value):
    def get(m):
        for part in path.split("."):
            m = getattr(m, part)
        return m

    assert get(module).shape == value.shape, path
    return eqx.tree_at(get, module, value)


def _theirs_v3(cfg, x):
    attn = _perturbed(v3.DeepseekV3Attention(cfg, 0), 1).eval()
    rotary = v3.DeepseekV3RotaryEmbedding(cfg)
    xt = _t(x)[None]
    positions = torch.arange(SEQ)[None]
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = attn(xt, rotary(xt, positions), mask)[0][0]
    return attn, _n(out)


SLOW = pytest.mark.slow
X = np.random.default_rng(0).normal(size=(SEQ, D)).astype(np.float32)


@pytest.mark.parametrize(
    "changes, interleaved",
    [
        ({}, True),  # V3's defaults: query latent, rope_interleave
        pytest.param({"q_lora_rank": None, "rope_interleave": False}, False, marks=SLOW),
        ({"rope_parameters": YARN}, True),
    ],
    ids=["q-lora", "direct-q-half-rotation", "yarn-mscale"],
)
def test_mla_equals_deepseek_v3_attention(changes, interleaved):
    cfg = _v3_config(**changes)
    theirs, ref = _theirs_v3(cfg, X)
    ours = _mla_from(theirs, cfg, interleaved)
    np.testing.assert_allclose(np.asarray(_call(ours, jnp.asarray(X))), ref, atol=1e-5, rtol=0)
    if changes.get("rope_parameters"):  # the mscale is not 1 there: leaving it out differs
        plain = _mla_from(theirs, cfg, interleaved, mscale=False)
        assert np.abs(np.asarray(_call(plain, jnp.asarray(X))) - ref).max() > 1e-3


@SLOW
def test_mla_equals_deepseek_v2_attention():
    """V2 rotates interleaved pairs as complex numbers and keeps them interleaved: the scores
    equal the de-interleaved rotation's."""
    spec = _v3_config().to_dict()
    spec = {k: spec[k] for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                 "num_key_value_heads", "max_position_embeddings")}  # fmt: skip
    cfg = DeepseekV2Config(
        **spec,
        num_hidden_layers=1,
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MLA_DIMS,
    )
    cfg._attn_implementation = "eager"
    attn = _perturbed(v2.DeepseekV2Attention(cfg, 0), 2).eval()
    rotary = v2.DeepseekV2RotaryEmbedding(cfg)
    xt = _t(X)[None]
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = _n(attn(xt, mask, position_embeddings=rotary(xt, torch.arange(SEQ)[None]))[0][0])
    ours = _mla_from(attn, cfg, interleaved=True)
    np.testing.assert_allclose(np.asarray(_call(ours, jnp.asarray(X))), ref, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def v3_attention():
    cfg = _v3_config(rope_parameters=YARN)
    return _theirs_v3(cfg, X)[0], cfg


@pytest.mark.parametrize(
    "absorb", [True, pytest.param(False, marks=SLOW)], ids=["absorbed", "expanded"]
)
def test_cached_decoding_from_latents_equals_the_full_forward(v3_attention, absorb):
    model = _mla_from(*v3_attention, True, absorb=absorb)
    full = np.asarray(_call(model, jnp.asarray(X)))
    cache = LatentCache.empty(SEQ, MLA_DIMS["kv_lora_rank"], MLA_DIMS["qk_rope_head_dim"])
    prompt = 25
    step = eqx.filter_jit(lambda m, x, p, c: m.cached(x, p, c))
    out, cache = step(model, jnp.asarray(X[:prompt]), jnp.arange(prompt), cache)
    outs = [np.asarray(out)]
    for t in range(prompt, SEQ):
        out, cache = step(model, jnp.asarray(X[t : t + 1]), jnp.arange(t, t + 1), cache)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs), full, atol=2e-5, rtol=0)
    assert cache.latent.shape == (SEQ, MLA_DIMS["kv_lora_rank"])


def test_latent_cache_is_smaller_than_grouped_query_attention():
    """Per token and layer, DeepSeek-V3's sizes: the latent cache holds kv_lora_rank + rope
    numbers (576), multi-head attention's cache keys and values of every head (128 x 192)."""
    latent = LatentCache.empty(10, 512, 64)
    gqa = KVCache.empty(10, 128, 192)
    per_token = (latent.latent.nbytes + latent.rope_key.nbytes) // 10
    assert per_token == (512 + 64) * 4
    assert (gqa.k.nbytes + gqa.v.nbytes) // 10 == 2 * 128 * 192 * 4 > 85 * per_token


# Routing ----------------------------------------------------------------------------------------


def _moe_from(theirs, cfg, **routing):
    ours = MoE(
        D,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        shared_d_ff=cfg.moe_intermediate_size * cfg.n_shared_experts,
        shared_gated=False,
        routed_scale=cfg.routed_scaling_factor,
        key=jax.random.key(1),
        **routing,
    )
    w = {k: jnp.asarray(_n(v)) for k, v in theirs.state_dict().items()}
    i = cfg.moe_intermediate_size
    if "experts.gate_up_proj" in w:
        gate_up = w["experts.gate_up_proj"]
        ours = _set(ours, "gate.weight", gate_up[:, :i])
        ours = _set(ours, "up.weight", gate_up[:, i:])
        ours = _set(ours, "down.weight", w["experts.down_proj"])
    ours = _set(ours, "router.weight", w["gate.weight"])
    for part in ("gate", "up", "down"):
        ours = _set(ours, f"shared.{part}.weight", w[f"shared_experts.{part}_proj.weight"])
    if "gate.e_score_correction_bias" in w:
        ours = _set(ours, "score_bias", w["gate.e_score_correction_bias"])
    return ours


@pytest.mark.parametrize(
    "groups", [True, pytest.param(False, marks=SLOW)], ids=["group-limited", "no-groups"]
)
def test_sigmoid_routing_equals_deepseek_v3_moe(groups):
    changes = {} if groups else {"n_group": 1, "topk_group": 1}
    cfg = _v3_config(routed_scaling_factor=2.5, norm_topk_prob=True, **changes)
    theirs = _perturbed(v3.DeepseekV3MoE(cfg), 3).eval()
    with torch.no_grad():  # a large correction bias: it changes which experts are chosen
        theirs.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
        ref = _n(theirs(_t(X)[None])[0])
    ours = _moe_from(
        theirs,
        cfg,
        normalize=True,
        scoring="sigmoid",
        score_bias=True,
        n_groups=cfg.n_group if groups else None,
        topk_groups=cfg.topk_group if groups else None,
        group_score="top2_sum",
    )
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(np.asarray(_call(ours, jnp.asarray(X))), ref, atol=1e-5, rtol=1e-5)
    ragged = eqx.filter_jit(lambda m, x: m.routed(x, "ragged")[0])(ours, jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(ragged), ref, atol=1e-5, rtol=1e-5)
    # The bias chooses but does not weigh: without it, other experts and other outputs.
    unbiased = _set(ours, "score_bias", jnp.zeros(8))
    assert np.abs(np.asarray(_call(unbiased, jnp.asarray(X))) - ref).max() > 1e-3


@pytest.mark.parametrize("method", [pytest.param("greedy", marks=SLOW), "group_limited_greedy"])
def test_softmax_routing_equals_deepseek_v2_moe(method):
    cfg = DeepseekV2Config(
        hidden_size=D,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.7,
    )
    theirs = _perturbed(v2.DeepseekV2Moe(cfg), 4).eval()
    with torch.no_grad():
        ref = _n(theirs(_t(X)[None])[0])
    assert np.isfinite(ref).all()
    grouped = method == "group_limited_greedy"
    ours = _moe_from(
        theirs,
        cfg,
        normalize=False,
        n_groups=4 if grouped else None,
        topk_groups=2 if grouped else None,
        group_score="max",
    )
    np.testing.assert_allclose(np.asarray(_call(ours, jnp.asarray(X))), ref, atol=1e-5, rtol=0)
