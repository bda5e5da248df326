"""SmolLM3 beyond the family contract (tests/test_families.py: logits both ways, scanned ==
unrolled, cached decoding, published counts): NoPE layers (no rotary embedding on every k-th
layer) as per-layer data in the stack, read and written as transformers' no_rope_layers, and the
settings eqllm refuses.

The model is tests/families.py's twin: a tiny random SmolLM3ForCausalLM with every parameter
perturbed (no downloads).
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.hub import from_hf_config, to_hf_config
from tests.hf_parity import TOKENS, logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(twins):
    """tests/families.py's tiny SmolLM3 (4 layers, every second one NoPE), its transformers twin
    and eqllm's import of it."""
    return twins("smollm3")


def test_import_reads_the_nope_layers(pair):
    assert pair.hf.config.no_rope_layers == [1, 0, 1, 0]
    cfg = pair.model.config
    assert cfg.family == "smollm3" and cfg.positions.nope_every == 2 and cfg.tie_embeddings
    assert cfg.rotary_layers() == (True, False, True, False)


def test_nope_layers_change_the_logits(pair):
    """The same weights with every layer rotated are far from transformers: the parity above
    depends on the NoPE layers."""
    cfg = pair.model.config.replace(positions={"nope_every": None})
    skeleton = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    rotated = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(pair.model))
    assert np.abs(logits(rotated, TOKENS) - pair.ref).max() > 1e-2


def test_export_writes_the_nope_layers(pair, tmp_path):
    eqllm.hub.save_pretrained(pair.model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["no_rope_layers"] == [1, 0, 1, 0]


def test_nano_trains_in_the_scanned_stack():
    """smollm3-nano's NoPE layers are per-layer data of one scanned body: the scanned and the
    unrolled model agree, and its gradients are finite."""
    cfg = eqllm.zoo.config("smollm3-nano", max_seq_len=64)
    assert cfg.rotary_layers().count(False) == 2
    model = eqllm.zoo.create("smollm3-nano", key=jax.random.key(0), max_seq_len=64)
    scanned = model.with_config(scan_layers=True)
    tokens = TOKENS[:64] % cfg.vocab_size
    np.testing.assert_allclose(logits(scanned, tokens), logits(model, tokens), atol=1e-5)

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(m, t):
        return -jnp.mean(jax.nn.log_softmax(m(t[:-1]))[jnp.arange(t.size - 1), t[1:]])

    leaves = jax.tree.leaves(grad(scanned, jnp.asarray(tokens)))
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)


def test_no_rope_layer_interval_alone_builds_the_pattern():
    hf = to_hf_config(eqllm.zoo.config("smollm3-nano"))
    del hf["no_rope_layers"], hf["layer_types"]
    assert (
        from_hf_config({**hf, "no_rope_layer_interval": 2}).rotary_layers()
        == (
            True,
            False,
        )
        * 4
    )
    del hf["no_rope_layer_interval"]  # SmolLM3Config's default: every fourth
    assert from_hf_config(hf).positions.nope_every == 4


def test_every_layer_rotated_reads_as_no_nope_layers():
    hf = to_hf_config(eqllm.zoo.config("smollm3-nano"))
    cfg = from_hf_config({**hf, "no_rope_layers": [1] * 8})
    assert cfg.positions.nope_every is None and all(cfg.rotary_layers())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"no_rope_layers": [1, 0, 0, 1, 1, 1, 1, 0]}, "no_rope_layers=.*every k-th layer"),
        ({"no_rope_layers": [1, 1, 1, 0]}, "has 4 entries for num_hidden_layers=8"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=True"),
        ({"layer_types": ["sliding_attention"] * 8}, "layer_types="),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_settings_are_refused(change, message):
    hf = {**to_hf_config(eqllm.zoo.config("smollm3-nano")), **change}
    with pytest.raises(eqllm.ConfigError, match=message):
        from_hf_config(hf)


def test_nope_every_is_validated_with_its_path():
    with pytest.raises(eqllm.ConfigError, match=r"ModelConfig.positions.nope_every=0 "):
        eqllm.zoo.config("smollm3-nano", **{"positions.nope_every": 0})
    with pytest.raises(eqllm.ConfigError, match=r"positions.nope_every=4 needs kind='rope'"):
        eqllm.zoo.config("gpt2-nano", **{"positions.nope_every": 4})


def test_other_families_refuse_to_export_nope_layers():
    cfg = eqllm.zoo.config("llama-nano", **{"positions.nope_every": 4})
    assert cfg.rotary_layers() == (True, True, True, False)
    with pytest.raises(eqllm.ConfigError, match="positions.nope_every"):
        to_hf_config(cfg)
