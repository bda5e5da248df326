"""Gemma 4 beyond the family contract (tests/test_families.py: logits both ways, scanned ==
unrolled, cached decoding, greedy generation, LoRA against peft): the published multimodal
checkpoint read for its language model, the global layers' own cache shape, the published 31B's
and 26B-A4B's settings and counts, 26B-A4B's experts block against transformers in the default
run (the contract runs its tiny variant in the slow set), FLOPs with the global layers' own
heads, and the mechanisms of the other published sizes refused by name.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import eqllm
from eqllm.hub import from_hf_config
from tests.conftest import cached_logits
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "hf_configs"
PUBLISHED = json.loads((DATA / "gemma4-31b.json").read_text())
PUBLISHED_MOE = json.loads((DATA / "gemma4-26b-a4b.json").read_text())


@pytest.fixture(scope="module")
def pair(twins):
    """tests/families.py's tiny Gemma 4 (local, global, local, global layers; the global ones
    with wider heads, one kv head whose values are its keys, proportional RoPE), its
    transformers twin and eqllm's import of it."""
    return twins("gemma4")


def test_the_global_layers_are_a_stack_of_their_own(pair):
    model = pair.model
    assert model.config.layer_kinds() == ("full", "global") * 2
    assert model.global_blocks.attn.v_proj is None  # keys are values
    assert model.global_blocks.attn.k_proj.weight.shape == (2, 16, 32)  # 1 kv head of 16
    assert model.blocks.attn.k_proj.weight.shape == (2, 16, 32)  # 2 kv heads of 8
    # The cache holds each kind's own heads: the global layers' (1, 16), the local ones' (2, 8).
    cache = model.init_cache(64)
    assert [c.k.shape[1:] for c in cache] == [(2, 8), (1, 16)] * 2


def test_the_multimodal_checkpoint_reads_its_language_model(pair, tmp_path, caplog):
    """Gemma4ForConditionalGeneration as transformers saves it (`model.language_model.*` beside
    a vision tower and its embedder): eqllm imports the text model with transformers' logits
    and says in one line what it left out."""
    text = pair.hf.config.to_dict()
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "patch_size": 4,
        "position_embedding_size": 16,
    }
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    both = transformers.Gemma4ForConditionalGeneration(config).eval()
    both.model.language_model.load_state_dict(pair.hf.model.state_dict())
    both.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gemma4" and "vision_config" in written
    model = eqllm.hub.from_pretrained(tmp_path)
    assert "left out:" in caplog.text and "vision_config" in caplog.text
    assert model.config == pair.model.config
    np.testing.assert_allclose(logits(model, TOKENS), pair.ref, atol=3e-5, rtol=0)


def test_published_31b_reads_its_settings():
    cfg = from_hf_config(PUBLISHED)
    a = cfg.attention
    assert (a.head_dim, a.n_kv_heads, a.global_head_dim, a.global_kv_heads) == (256, 16, 512, 4)
    assert a.k_eq_v and a.v_norm and a.query_pre_attn_scalar == 1
    assert (a.sliding_window, a.global_every, cfg.final_softcap) == (1024, 6, 30.0)
    assert cfg.positions.global_fraction == 0.25 and cfg.positions.local_theta == 10_000.0
    # Built abstractly: the global layers' caches are 4 kv heads of 512.
    model = jax.eval_shape(lambda: eqllm.CausalLM(cfg, key=jax.random.key(0)))
    assert model.global_blocks.attn.k_proj.weight.shape == (10, 4 * 512, 5376)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_kv_shared_layers": 60}, "kv_shared_layers=60"),  # no layer left with keys
        ({"enable_moe_block": True, "num_experts": 128}, "needs moe_intermediate_size"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_hidden_layers": 58, "layer_types": None}, "num_hidden_layers=58"),
    ],
)
def test_other_sizes_mechanisms_are_refused_by_name(change, named):
    """Experts without their size, and shared caches with no layer left to compute keys: one
    line naming the config.json field and its value, never a silently different model."""
    text = {k: v for k, v in {**PUBLISHED["text_config"], **change}.items() if v is not None}
    with pytest.raises(eqllm.ConfigError, match=named):
        from_hf_config({**PUBLISHED, "text_config": text})


def test_missing_rope_parameters_read_transformers_defaults():
    """Without rope_parameters transformers turns a quarter of the global frequencies (base 1e6)
    and the whole local heads (base 1e4)."""
    text = {k: v for k, v in PUBLISHED["text_config"].items() if k != "rope_parameters"}
    pos = from_hf_config({**PUBLISHED, "text_config": text}).positions
    assert (pos.theta, pos.local_theta, pos.global_fraction) == (1e6, 1e4, 0.25)


# 26B-A4B's experts block ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe(twins):
    """tests/families.py's tiny 26B-A4B block (the dense MLP beside 4 experts, 2 per token, on
    the tiny Gemma 4's layers), its perturbed transformers twin and eqllm's import of it."""
    return twins("gemma4-moe")


def test_experts_block_matches_transformers_both_ways(moe, tmp_path):
    """Imported with transformers' logits; exported, transformers loads the very tensors (the
    fused experts, the router's scales, the branch norms) with the same logits, and eqllm reads
    its export back bit for bit."""
    mlp = moe.model.blocks.mlp
    assert mlp.shared is not None and mlp.experts_norm is not None
    assert moe.model.blocks.mlp_norm is None  # each branch norms its own input
    assert float(np.abs(np.asarray(mlp.expert_scale) - 1).max()) > 0.01  # perturbed, read
    np.testing.assert_allclose(logits(moe.model, TOKENS), moe.ref, atol=moe.tiny.atol, rtol=0)
    eqllm.hub.save_pretrained(moe.model, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    state = reloaded.eval().state_dict()
    assert state.keys() == moe.hf.state_dict().keys()
    for name, p in moe.hf.state_dict().items():
        np.testing.assert_array_equal(state[name].numpy(), p.numpy(), name)
    with torch.no_grad():
        exported = reloaded(torch.tensor(TOKENS)[None]).logits[0].numpy()
    np.testing.assert_allclose(exported, moe.ref, atol=moe.tiny.atol, rtol=0)
    again = eqllm.hub.from_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(moe.model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_experts_block_scans_and_decodes_as_its_full_forward(moe):
    """Scanned == unrolled, and prefill then one token at a time (past the window of 5) gives
    the full forward's logits."""
    full = logits(moe.model, TOKENS)
    unrolled = moe.model.with_config(scan_layers=False)
    np.testing.assert_allclose(logits(unrolled, TOKENS), full, atol=moe.tiny.scan_atol, rtol=0)
    cached = cached_logits(moe.model, TOKENS[:48], 20)
    np.testing.assert_allclose(cached, full[19:47], atol=1e-5, rtol=0)


def test_what_walks_the_model_reaches_the_experts_block(moe):
    """LoRA names are transformers' module names (the dense MLP's, the router's `proj`; the
    fused experts are no modules), and every array carries its metadata (sharding,
    initialisation and muP roles are read off it)."""
    from eqllm.nn.params import is_param_info

    targets = set(eqllm.lora.available_targets(moe.model))
    linear = {n.rsplit(".", 1)[-1] for n, m in moe.hf.named_modules() if type(m) is torch.nn.Linear}
    assert {"gate_proj", "up_proj", "down_proj", "proj"} <= targets <= linear
    infos = jax.tree.leaves(eqllm.nn.param_info(moe.model), is_leaf=is_param_info)
    assert len(infos) == len(jax.tree.leaves(moe.model))
    mlp = eqllm.nn.param_info(moe.model).blocks.mlp
    assert mlp.gate.weight.axes == (None, "expert", "d_ff", "d_model")


@pytest.mark.slow
def test_int8_quantizes_the_dense_mlp_and_the_router(moe):
    """int8 replaces the dense MLP's and the router's linear layers (the experts stay), and the
    quantized model computes what its rounded weights do."""
    from eqllm.nn.linear import Int8Linear
    from tests.test_quantize import _dequantized

    q = eqllm.quantize(moe.model, "int8")
    assert isinstance(q.blocks.mlp.router, Int8Linear)
    assert isinstance(q.global_blocks.mlp.shared.down, Int8Linear)
    # the model of the rounded weights (rounding the router's moves a few tokens' experts)
    np.testing.assert_allclose(logits(q, TOKENS), logits(_dequantized(q), TOKENS), atol=1e-4)


def test_published_26b_a4b_reads_its_experts():
    cfg = from_hf_config(PUBLISHED_MOE)
    assert eqllm.hub.zoo_match(cfg) == "gemma4-26b-a4b"
    moe = cfg.moe
    assert (moe.n_experts, moe.experts_per_token, moe.d_ff) == (128, 8, 704)
    assert moe.shared_d_ff == cfg.mlp.d_ff == 2112 and not moe.shared_gated
    assert moe.router_norm and moe.expert_scale and moe.branch_norms
    assert (moe.activation, cfg.mlp.kind) == ("geglu", "geglu")
    a = cfg.attention
    assert (a.head_dim, a.n_kv_heads, a.global_head_dim, a.global_kv_heads) == (256, 8, 512, 2)


def test_published_26b_a4b_active_count_equals_transformers():
    """Total and active parameters against transformers' model of the same config.json on the
    meta device: the active count leaves out the experts a token does not reach (120 of 128 in
    each layer), counted from transformers' fused expert tensors."""
    text = transformers.AutoConfig.for_model(**PUBLISHED_MOE["text_config"])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(text)
    params = dict(hf.named_parameters())
    total = sum(p.numel() for p in params.values())
    total += sum(b.numel() for n, b in hf.named_buffers() if n.endswith(".layer_scalar"))
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert eqllm.zoo.param_count("gemma4-26b-a4b") == total
    assert eqllm.zoo.active_param_count("gemma4-26b-a4b") == total - experts * 120 // 128


def test_flops_count_the_global_layers_own_heads():
    """By hand, tests/families.py's tiny Gemma 4 (width 32, 4 heads; local layers: 2 kv heads
    of 8, a window of 5; global layers: heads of 16, 1 kv head whose values are its keys; GeGLU
    of 64; 97 tokens, tied) at 64 positions, and its experts variant."""
    from tests.families import TINY_CONFIGS

    local = 32 * 4 * 8 + 32 * 2 * 8 * 2 + 4 * 8 * 32  # q, k, v, o
    wide = 32 * 4 * 16 + 32 * 1 * 16 + 4 * 16 * 32  # q, k (= v), o
    mlp, head = 3 * 32 * 64, 32 * 97
    # scores and weighted sums: heads x (query + value size) x positions attended, 6 per FLOP
    scores = 6 * 4 * (2 * (8 + 8) * 5 + 2 * (16 + 16) * 64)
    dense = 6 * (2 * local + 2 * wide + 4 * mlp + head) + scores
    assert TINY_CONFIGS["gemma4"].flops_per_token(64) == dense
    experts = 32 * 4 + 3 * 32 * 16 * 2 + 3 * 32 * 64  # router, 2 experts of 16, the dense MLP
    sparse = 6 * (2 * local + 2 * wide + 4 * experts + head) + scores
    assert TINY_CONFIGS["gemma4-moe"].flops_per_token(64) == sparse
