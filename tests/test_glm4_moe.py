"""GLM-4.5 beyond the family contract (tests/test_families.py: logits both ways, scanned ==
unrolled, cached decoding, LoRA against peft, published counts): the settings read (half of
each head rotated, q/k/v biases without an output bias, QK-norm, a dense prefix, the shared
expert, one group as no grouping), multi-token-prediction layers skipped on import, the
settings refused (the nano size training on a CPU: tests/test_deepseek.py, beside
deepseek_v3-nano's).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eqllm
from tests.hf_parity import TOKENS, logits

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "hf_configs"


@pytest.fixture(scope="module")
def pair(twins):
    """tests/families.py's tiny GLM-4.5: its transformers twin, saved, and eqllm's import."""
    return twins("glm4_moe")


def test_import_reads_the_family(pair):
    cfg = pair.model.config
    a, moe = cfg.attention, cfg.moe
    assert (cfg.positions.fraction, cfg.rotary_dim) == (0.5, 8)
    assert (a.qkv_bias, a.out_bias, a.qk_norm) == (True, False, "head")
    assert (moe.dense_layers, moe.shared_d_ff, moe.shared_gated) == (1, 32, False)
    assert (moe.scoring, moe.score_bias, moe.n_groups, moe.topk_groups) == ("sigmoid", True, 4, 2)
    assert pair.model.dense_blocks is not None and pair.model.blocks.mlp.router.weight.shape[0] == 2
    assert np.abs(np.asarray(pair.model.blocks.mlp.score_bias)).max() > 0.05  # perturbed, read


def test_published_sizes_read_their_settings():
    """GLM-4.5 turns QK-norm on and scales the routed weights by 2.5 after 3 dense layers;
    GLM-4.5-Air has neither; both route in one group, which is no grouping."""
    big = eqllm.hub.from_hf_config(json.loads((DATA / "glm-4.5.json").read_text()))
    air = eqllm.hub.from_hf_config(json.loads((DATA / "glm-4.5-air.json").read_text()))
    assert (big.attention.qk_norm, big.moe.routed_scale, big.moe.dense_layers) == ("head", 2.5, 3)
    assert (air.attention.qk_norm, air.moe.routed_scale, air.moe.dense_layers) == (None, 1.0, 1)
    for cfg in (big, air):
        assert (cfg.moe.n_groups, cfg.rotary_dim, cfg.norms.eps) == (None, 64, 1e-5)


def test_multi_token_prediction_layers_are_skipped_with_a_message(pair, tmp_path, caplog):
    """GLM-4.5's checkpoints hold `num_nextn_predict_layers` layers after the last (with their
    own eh_proj, enorm, hnorm): read past, as transformers does."""
    hf = json.loads((pair.folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    tensors = load_file(pair.folder / "model.safetensors")
    last = f"model.layers.{hf['num_hidden_layers'] - 1}."
    extra = {k.replace(last, "model.layers.3."): v for k, v in tensors.items() if last in k}
    extra["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = eqllm.hub.from_pretrained(tmp_path)
    assert "skipping" in caplog.text and "layers [3]" in caplog.text
    np.testing.assert_allclose(logits(model, TOKENS[:30]), pair.ref[:30], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
        ({"n_group": 1, "topk_group": 2}, "topk_group=2 exceeds n_group=1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ],
)
def test_settings_outside_the_architecture_are_refused(change, message):
    hf = {**json.loads((DATA / "glm-4.5-air.json").read_text()), **change}
    with pytest.raises(eqllm.ConfigError, match=message):
        eqllm.hub.from_hf_config(hf)


def test_a_config_without_shared_experts_is_not_exported():
    cfg = eqllm.zoo.config("glm4_moe-nano", moe={"shared_d_ff": None})
    with pytest.raises(eqllm.ConfigError, match="moe.shared_d_ff"):
        eqllm.hub.to_hf_config(cfg)
