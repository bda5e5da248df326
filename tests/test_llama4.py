"""Llama 4 beyond the family contract (tests/test_families.py: logits both ways, scanned ==
unrolled, cached decoding, LoRA against peft, published counts): the settings read, each
mechanism's part in the parity (chunks, temperature tuning, the L2 QK-norm, adjacent rotary
pairs, experts that read the score-scaled token), the published vision-language checkpoint read
for its language model, packed documents, cached decoding across chunk boundaries in pieces,
Maverick's alternating dense and expert layers read from config.json, and the layouts refused
(expert layers not every k-th).
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.hub import from_hf_config, to_hf_config
from eqllm.nn import MoE
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "hf_configs"


@pytest.fixture(scope="module")
def pair(twins):
    """tests/families.py's tiny Llama 4 (chunked, global NoPE, chunked, global NoPE layers), its
    transformers twin and eqllm's import of it."""
    return twins("llama4")


def test_import_reads_the_family(pair):
    cfg, hf = pair.model.config, pair.hf.config
    assert hf.layer_types == ["chunked_attention", "full_attention"] * 2
    assert hf.no_rope_layers == [1, 0, 1, 0] and hf.moe_layers == [0, 1, 2, 3]
    a = cfg.attention
    assert (a.chunk_size, a.global_every, a.qk_norm, a.rope_interleave) == (8, 2, "l2", True)
    assert (a.temperature_floor, a.temperature_scale) == (16, 0.1)
    assert cfg.local_layers() == cfg.rotary_layers() == (True, False, True, False)
    moe = cfg.moe
    assert (moe.scoring, moe.score_input, moe.experts_per_token, moe.norm_topk_prob) == (
        "sigmoid",
        True,
        1,
        False,
    )
    assert (cfg.expert_d_ff, moe.shared_d_ff, moe.shared_gated, cfg.mlp.d_ff) == (16, 16, False, 64)


def _same_weights(model, **changes):
    """`model`'s weights under a changed architecture (to show what a setting does)."""
    cfg = model.config.replace(**changes)
    skeleton = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


@pytest.mark.parametrize(
    "change",
    [
        {"attention.chunk_size": 256},  # one chunk: plain causal attention
        pytest.param({"attention.temperature_floor": 10_000}, marks=pytest.mark.slow),
        pytest.param({"attention.qk_norm": None}, marks=pytest.mark.slow),
        pytest.param({"attention.rope_interleave": False}, marks=pytest.mark.slow),
        {"moe.score_input": False},  # the score weighs the expert's output instead
    ],
    ids=["chunks", "temperature", "qk_norm", "interleave", "score_input"],
)
def test_each_mechanism_moves_the_logits(pair, change):
    """The same weights without one of Llama 4's mechanisms are far from transformers: the
    parity depends on each of them."""
    assert np.abs(logits(_same_weights(pair.model, **change), TOKENS) - pair.ref).max() > 1e-3


def test_the_vision_language_checkpoint_reads_its_language_model(pair, tmp_path, caplog):
    """Llama4ForConditionalGeneration as transformers saves it (`language_model.*` beside a
    vision tower and the projector): eqllm imports the text model with transformers' logits
    and says in one line what it left out."""
    text = pair.hf.config.to_dict()
    vision = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "vision_output_dim": 16,
        "projector_input_dim": 16,
        "projector_output_dim": 16,
        "image_size": 8,
        "patch_size": 4,
    }
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    both = transformers.Llama4ForConditionalGeneration(config).eval()
    both.language_model.load_state_dict(pair.hf.state_dict())
    both.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "llama4" and "vision_config" in written
    model = eqllm.hub.from_pretrained(tmp_path)
    assert "left out: vision_config" in caplog.text and "skipping" in caplog.text
    assert model.config == pair.model.config
    np.testing.assert_allclose(logits(model, TOKENS), pair.ref, atol=1e-5, rtol=0)


def test_published_scout_reads_its_settings():
    cfg = from_hf_config(json.loads((DATA / "llama4-scout.json").read_text()))
    a = cfg.attention
    assert (a.chunk_size, a.global_every, a.temperature_floor, a.qk_norm) == (8192, 4, 8192, "l2")
    assert cfg.positions.scaling.kind == "llama3" and cfg.positions.nope_every == 4
    assert (cfg.moe.n_experts, cfg.expert_d_ff, cfg.mlp.d_ff) == (16, 8192, 16384)


def test_packed_documents_compute_what_they_compute_alone(pair):
    """Two documents packed in one row, positions restarting: each one's logits are its own,
    chunks counted from its start (neither length is a multiple of the chunk)."""
    a, b = TOKENS[:37], TOKENS[40:69]
    packed = jnp.asarray(np.concatenate([a, b]))
    positions = jnp.asarray(np.concatenate([np.arange(37), np.arange(29)]))
    segments = jnp.asarray(np.repeat([0, 1], [37, 29]))
    out = np.asarray(eqx.filter_jit(pair.model)(packed, positions, segments))
    np.testing.assert_allclose(out[:37], logits(pair.model, a), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[37:], logits(pair.model, b), atol=1e-5, rtol=0)


@pytest.mark.slow  # a compile per piece; the contract decodes across boundaries by default
def test_cached_prefill_in_pieces_across_chunk_boundaries(pair):
    """Prefill in pieces that start and end inside chunks (5, then 14 across the boundary at 8
    and 16, then 16 from a boundary), then decode across two more: every logit equals the full
    forward's (the chunked layers keep a ring of one chunk)."""
    model, length = pair.model, 60
    full = logits(model, TOKENS)
    tokens = jnp.asarray(TOKENS[:length])
    cache = model.init_cache(length)
    assert {c.slots for c in cache} == {8, length}  # chunked layers: a ring of one chunk
    prefill = eqx.filter_jit(lambda m, t, p, c: m.prefill(t, p, c))
    ends, got = [5, 19, 35, 36, 40, 41, 48, 49, 57], []
    start = 0
    for end in ends:
        out, cache = prefill(model, tokens[start:end], jnp.arange(start, end), cache)
        got.append(np.asarray(out))
        start = end
    want = full[np.array(ends) - 1]
    np.testing.assert_allclose(np.stack(got), want, atol=1e-5, rtol=0)


def test_experts_read_the_scaled_token():
    """MoE(score_input): out = shared(x) + sum over its top-1 expert e of expert_e(w_e * x), the
    same computed densely and grouped; the dispatch path refuses more than one expert a token."""
    settings = dict(normalize=False, shared_d_ff=12, shared_gated=False, scoring="sigmoid")

    @eqx.filter_jit  # built eagerly, a layer costs a compile per operation
    def build(key, k):
        return MoE(8, 12, 4, k, **settings, score_input=True, key=key)

    @eqx.filter_jit  # compiled once, not op by op
    def reference(moe, x):
        logits = moe.router(x)
        e = jnp.argmax(logits, -1)
        w = jax.nn.sigmoid(jnp.take_along_axis(logits, e[:, None], -1))
        scaled = w * x  # each token times its expert's score, then through that expert alone
        h = jax.nn.silu(jnp.einsum("tfd,td->tf", moe.gate.weight[e], scaled))
        h = h * jnp.einsum("tfd,td->tf", moe.up.weight[e], scaled)
        return moe.shared(x) + jnp.einsum("tdf,tf->td", moe.down.weight[e], h)

    moe = build(jax.random.key(0), 1)
    x = jax.random.normal(jax.random.key(1), (10, 8))
    want = reference(moe, x)
    routed = eqx.filter_jit(lambda m, x, impl: m.routed(x, impl)[0])
    for impl in ("dense", "ragged"):
        np.testing.assert_allclose(routed(moe, x, impl), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="score_input with 'dispatch' needs top_k=1"):
        routed(build(jax.random.key(0), 2), x, "dispatch")


def _published_text() -> dict:
    return json.loads((DATA / "llama4-scout.json").read_text())["text_config"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"moe_layers": [0, 2]}, r"moe_layers=\[0, 2\] is not supported.*every k-th layer"),
        ({"moe_layers": []}, "has no expert layer"),
        ({"layer_types": ["full_attention"] * 48}, "layer_types="),
        ({"no_rope_layers": [1, 0, 0, 1] * 12}, "no_rope_layers="),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"floor_scale": 2.5}, "floor_scale=2.5"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_settings_outside_the_architecture_are_refused(change, message):
    with pytest.raises(eqllm.ConfigError, match=message):
        from_hf_config({**_published_text(), **change})


@pytest.mark.parametrize("layers", [None, list(range(1, 48, 2))])
def test_maverick_s_alternating_layers_read_as_dense_and_expert_stacks(layers):
    """interleave_moe_layer_step 2 (or its moe_layers written out): experts in every second
    layer, the others dense; written back with transformers' list of expert layers."""
    hf = {**_published_text(), "interleave_moe_layer_step": 2, "moe_layers": layers}
    cfg = from_hf_config(hf)
    assert cfg.moe.sparse_every == 2
    assert cfg.layer_kinds() == ("dense", "full") * 24
    out = to_hf_config(cfg)
    assert out["interleave_moe_layer_step"] == 2 and out["moe_layers"] == list(range(1, 48, 2))
    assert from_hf_config(out) == cfg


def test_no_chunks_and_no_tuning_read_as_plain_attention():
    """attention_chunk_size null: every layer attends globally; attn_temperature_tuning off:
    the NoPE layers keep their queries; exported and read back the same."""
    hf = {**_published_text(), "attention_chunk_size": None, "attn_temperature_tuning": False}
    cfg = from_hf_config(hf)
    assert cfg.attention.chunk_size is None and cfg.attention.global_every is None
    assert cfg.attention.temperature_floor is None and not any(cfg.local_layers())
    assert to_hf_config(cfg)["layer_types"] == ["full_attention"] * 48
    assert from_hf_config(to_hf_config(cfg)) == cfg


def test_other_families_refuse_llama4_mechanisms_on_export():
    cfg = eqllm.zoo.config("llama-nano", **{"attention.chunk_size": 8, "attention.global_every": 4})
    with pytest.raises(eqllm.ConfigError, match="attention.chunk_size"):
        to_hf_config(cfg)
    cfg = eqllm.zoo.config("mixtral-nano", **{"moe.score_input": True})
    with pytest.raises(eqllm.ConfigError, match="moe.score_input"):
        to_hf_config(cfg)


def test_chunk_settings_are_validated_with_their_paths():
    with pytest.raises(eqllm.ConfigError, match="chunk_size=32 cannot combine with sliding_window"):
        eqllm.zoo.config("llama4-nano", **{"attention.sliding_window": 16})
    with pytest.raises(eqllm.ConfigError, match="temperature_scale=None must be set exactly"):
        eqllm.zoo.config("llama4-nano", **{"attention.temperature_scale": None})
