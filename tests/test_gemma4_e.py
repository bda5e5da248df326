"""Gemma 4 E2B/E4B's mechanisms on tests/families.py's tiny "gemma4-e" (per-layer inputs of 8; a
local and a global layer, then four kv-shared layers with a double-wide MLP), against its
transformers twin: logits both ways, the exported tensors read back bit for bit, scanned ==
unrolled, cached decoding == the full forward, greedy decoding == transformers' generate
(through the serving engine), packed == alone, peft's module names; the stacks, caches and
roles the mechanisms give; the published E2B and E4B read as their zoo sizes.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.config.per_layer import kv_sources
from eqllm.generation.paged import bytes_per_token
from eqllm.nn import Int8Embedding, Int8Linear
from eqllm.parametrization import roles
from eqllm.sharding.rules import RULES, model_param_info
from tests.conftest import cached_logits
from tests.hf_parity import TOKENS, check_greedy_generate, hf_logits, logits
from tests.test_quantize import _dequantized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "hf_configs"


@pytest.fixture(scope="module")
def pair(twins):
    return twins("gemma4-e")


def test_the_shared_layers_are_stacks_without_keys(pair):
    model = pair.model
    cfg = model.config
    assert cfg.layer_kinds() == ("full", "global") + ("shared", "shared_global") * 2
    assert kv_sources(cfg) == {2: 0, 3: 1, 4: 0, 5: 1}
    shared = model.shared_blocks.attn
    assert shared.k_proj is None and shared.v_proj is None and shared.k_norm is None
    assert model.shared_blocks.mlp.up.weight.shape[-2] == 128  # twice d_ff
    assert model.blocks.mlp.up.weight.shape[-2] == 64
    # The shared layers keep no cache: two entries for six layers.
    cache = model.init_cache(64)
    assert [c is None for c in cache] == [False, False, True, True, True, True]
    assert model.per_layer.embed.weight.shape == (97, 6 * 8)


def test_import_gives_transformers_logits(pair):
    np.testing.assert_allclose(logits(pair.model, TOKENS), pair.ref, atol=3e-5, rtol=0)


def test_export_loads_in_transformers_and_reads_back_bit_for_bit(pair, tmp_path):
    """transformers loads the export with the very tensors of the original (the shared layers
    without k_proj, v_proj, k_norm); eqllm reads it back bit for bit."""
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(hf, TOKENS), pair.ref, atol=1e-5, rtol=0)
    state = hf.state_dict()
    assert set(state) == set(pair.hf.state_dict())
    for name, p in pair.hf.state_dict().items():
        np.testing.assert_array_equal(state[name].numpy(), p.numpy(), name)
    back = eqllm.hub.from_pretrained(tmp_path)
    assert back.config == pair.model.config
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(pair.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scanned_equals_unrolled(pair):
    unrolled = pair.model.with_config(scan_layers=False)
    np.testing.assert_allclose(
        logits(unrolled, TOKENS), logits(pair.model, TOKENS), atol=1e-5, rtol=0
    )


def test_cached_decoding_equals_the_full_forward(pair):
    """Prefill 20 (past the window of 5), then token by token: the shared layers read their
    sources' caches as they were before each chunk, plus the chunk's keys."""
    full = logits(pair.model, TOKENS)
    cached = cached_logits(pair.model, TOKENS[:48], 20)
    np.testing.assert_allclose(cached, full[19:47], atol=3e-5, rtol=0)


def test_greedy_equals_transformers_generate(pair):
    """eqllm.generate (the serving engine's paged cache: the shared layers have no pool) picks
    transformers' greedy continuation."""
    check_greedy_generate(pair)


def test_packed_equals_alone(pair):
    """Two documents packed in one row, positions restarting: each has its logits alone."""
    a, b = jnp.asarray(TOKENS[:30]), jnp.asarray(TOKENS[30:50])
    row = jnp.concatenate([a, b])
    segments = jnp.concatenate([jnp.zeros(30, jnp.int32), jnp.ones(20, jnp.int32)])
    positions = jnp.concatenate([jnp.arange(30), jnp.arange(20)])
    packed = eqx.filter_jit(lambda m, t, p, s: m(t, p, s))(pair.model, row, positions, segments)
    np.testing.assert_allclose(packed[:30], logits(pair.model, a), atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[30:], logits(pair.model, b), atol=1e-5, rtol=0)


def test_peft_names_the_per_layer_projections(pair, tmp_path):
    """peft's adapter on the per-layer projections and the queries (the shared layers have no
    k_proj: peft adapts those of the others) reads into eqllm with peft's logits."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "per_layer_input_gate", "per_layer_projection"]
    targets.append("per_layer_model_projection")
    assert set(targets) <= set(lora.available_targets(pair.model))
    base = transformers.AutoModelForCausalLM.from_pretrained(pair.folder, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(base.eval(), config).eval()
    peft_model.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(pair.folder, adapter=tmp_path)
    expected = hf_logits(peft_model, TOKENS)
    assert np.abs(expected - pair.ref).max() > 1e-3
    np.testing.assert_allclose(logits(model, TOKENS), expected, atol=1e-4, rtol=0)


def test_per_layer_weights_have_their_mup_roles(pair):
    """The per-layer table is an embedding (like the token table); the model's projection and
    each layer's gate read the width (readout: input wide, output fixed); each layer's
    projection back writes it (embedding: output wide)."""
    r = roles(pair.model)
    assert r.per_layer.embed.weight == "embedding"
    assert r.per_layer.project.weight == "readout"
    assert r.blocks.per_layer.gate.weight == "readout"
    assert r.shared_blocks.per_layer.out.weight == "embedding"


def test_e2b_needs_fewer_cache_bytes_per_token():
    """E2B's 20 shared layers hold no cache: 15 layers' keys and values per token, not 35."""
    cfg = eqllm.zoo.config("gemma4-e2b", compute_dtype="bfloat16")
    shared = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    alone = cfg.replace(**{"attention.kv_shared_layers": None, "mlp.kv_shared_d_ff": None})
    unshared = eqx.filter_eval_shape(eqllm.CausalLM, alone, key=jax.random.key(0))
    # 12 local layers of one kv head of 256, 3 global of one of 512; keys and values; bf16
    assert bytes_per_token(shared) == (12 * 256 + 3 * 512) * 2 * 2 == 18_432
    assert bytes_per_token(unshared) == (28 * 256 + 7 * 512) * 2 * 2 == 43_008


@pytest.mark.parametrize(("name", "first"), [("gemma4-e2b", 15), ("gemma4-e4b", 24)])
def test_published_sizes_share_from_their_last_layers_of_each_type(name, first):
    hf = json.loads((DATA / f"{name}.json").read_text())
    cfg = eqllm.hub.from_hf_config(hf)
    sources = kv_sources(cfg)
    assert min(sources) == first and set(sources.values()) == {first - 2, first - 1}
    assert cfg.per_layer.d == 256 and cfg.per_layer.vocab_size is None
    wide = cfg.mlp.kv_shared_d_ff
    assert wide == (2 * cfg.mlp.d_ff if name == "gemma4-e2b" else None)


def test_sharding_names_the_per_layer_axes(pair):
    """The per-layer weights carry their axes (the per-layer axis unsplit: it stays fixed as
    the width grows); the shared stacks' leading axis is `layers`, as every stack's."""
    info = model_param_info(pair.model)
    assert info.per_layer.embed.weight.axes == ("vocab", "per_layer")
    assert info.per_layer.project.weight.axes == ("per_layer", "d_model")
    assert info.shared_blocks.per_layer.gate.weight.axes == ("layers", "per_layer", "d_model")
    assert info.shared_global_blocks.attn.q_proj.weight.axes == ("layers", "heads", "d_model")
    assert RULES.get("per_layer") is None


def test_int8_quantizes_the_per_layer_table(pair):
    """int8 reaches the per-layer table and projections, and the model computes what its
    dequantized weights compute (tests/test_quantize.py's reference)."""
    model = eqllm.quantize(pair.model, "int8")
    assert isinstance(model.per_layer.embed, Int8Embedding)
    assert isinstance(model.shared_blocks.per_layer.gate, Int8Linear)
    assert isinstance(model.per_layer.project, Int8Linear)
    reference = _dequantized(model)
    np.testing.assert_allclose(
        logits(model, TOKENS[:64]), logits(reference, TOKENS[:64]), atol=1e-4, rtol=1e-4
    )


def test_flops_count_the_shared_layers_without_keys_and_the_per_layer_inputs():
    """By hand, tests/families.py's tiny E-style model (width 32, 4 heads; layers local, global,
    then 4 kv-shared ones alternating; local heads of 8 with 2 kv heads and a window of 5, global
    heads of 16 with 2 kv heads; GeGLU of 64, 128 on the shared layers; per-layer inputs of 8;
    97 tokens, tied) at 64 positions."""
    from tests.families import TINY_CONFIGS

    local, wide = 32 * 4 * 8 + 4 * 8 * 32, 32 * 4 * 16 + 4 * 16 * 32  # q and o
    keyed = local + 32 * 2 * 8 * 2 + wide + 32 * 2 * 16 * 2  # layers 0 and 1 add k and v
    attention = keyed + 2 * local + 2 * wide  # layers 2-5 read layers 0 and 1's keys
    mlp = 2 * 3 * 32 * 64 + 4 * 3 * 32 * 128
    per_layer = 32 * 6 * 8 + 6 * (32 * 8 + 8 * 32)  # the model's projection, each gate and out
    head = 32 * 97
    scores = 6 * 4 * 3 * (2 * 8 * 5 + 2 * 16 * 64)
    expected = 6 * (attention + mlp + per_layer + head) + scores
    assert TINY_CONFIGS["gemma4-e"].flops_per_token(64) == expected
