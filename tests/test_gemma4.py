"""Gemma 4 beyond the family contract (tests/test_families.py: logits both ways, scanned ==
unrolled, cached decoding, greedy generation, LoRA against peft): the published multimodal
checkpoint read for its language model, the global layers' own cache shape, the published 31B's
settings, and the mechanisms of the other published sizes refused by name.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import eqllm
from eqllm.hub import from_hf_config
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "hf_configs"
PUBLISHED = json.loads((DATA / "gemma4-31b.json").read_text())


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
        ({"enable_moe_block": True, "num_experts": 128}, "enable_moe_block=True"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_hidden_layers": 58, "layer_types": None}, "num_hidden_layers=58"),
    ],
)
def test_other_sizes_mechanisms_are_refused_by_name(change, named):
    """26B-A4B's experts, and shared caches with no layer left to compute keys: one line naming
    the config.json field and its value, never a silently different model."""
    text = {k: v for k, v in {**PUBLISHED["text_config"], **change}.items() if v is not None}
    with pytest.raises(eqllm.ConfigError, match=named):
        from_hf_config({**PUBLISHED, "text_config": text})


def test_missing_rope_parameters_read_transformers_defaults():
    """Without rope_parameters transformers turns a quarter of the global frequencies (base 1e6)
    and the whole local heads (base 1e4)."""
    text = {k: v for k, v in PUBLISHED["text_config"].items() if k != "rope_parameters"}
    pos = from_hf_config({**PUBLISHED, "text_config": text}).positions
    assert (pos.theta, pos.local_theta, pos.global_fraction) == (1e6, 1e4, 0.25)
