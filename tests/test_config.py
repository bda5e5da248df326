"""ModelConfig validation: every bad value is refused with a message naming field and rule."""

import pytest

from eqllm import ConfigError, ModelConfig

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_model=30), "n_heads=4 must divide d_model=30"),
        (dict(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
        (dict(norm="batchnorm"), "norm='batchnorm' must be one of"),
        (dict(n_layers=0), "n_layers=0 must be positive"),
        (dict(vocab_size=-1), "vocab_size=-1 must be positive"),
        (dict(d_model=36, n_heads=4, head_dim=9), "head_dim=9 must be even"),
        (dict(d_model=12, n_heads=4), "head_dim=3 must be even"),
        (dict(mlp="relu"), "mlp='relu' must be one of"),
        (dict(d_ff=64.0), "d_ff=64.0 must be of type int"),
        (dict(tie_embeddings="yes"), "tie_embeddings='yes' must be of type bool"),
        (dict(sliding_window=0), "sliding_window=0 must be positive"),
        (dict(norm_eps=float("nan")), "norm_eps=nan must be of type float"),
        (dict(rope_scaling="yarn"), "rope_scaling='yarn' must be one of"),
        (dict(norm_bias=True), "norm_bias=True is only defined for norm='layernorm'"),
        (dict(remat="some"), "remat='some' must be one of"),
    ],
)
def test_invalid_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig(**{**BASE, **overrides})


def test_defaults_and_derived_sizes():
    cfg = ModelConfig(**BASE)
    assert cfg.n_kv_heads == 4 and cfg.dim_per_head == 8
    assert ModelConfig(**BASE, head_dim=16).dim_per_head == 16


def test_round_trip_through_dict():
    cfg = ModelConfig(**BASE, n_kv_heads=2, sliding_window=8)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="missing required"):
        ModelConfig.from_dict({"d_model": 32})


def test_flops_per_token_hand_computed():
    """6N + 12 L H Q T for a config small enough to count by hand."""
    cfg = ModelConfig(**BASE)  # swiglu, untied, no GQA
    attn = 4 * 32 * 32
    mlp = 3 * 32 * 64
    n_matmul = 2 * (attn + mlp) + 32 * 64
    assert cfg.flops_per_token(16) == 6 * n_matmul + 12 * 2 * 4 * 8 * 16
