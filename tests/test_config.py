"""ModelConfig validation: every bad value is refused with one line naming field, value and rule."""

from typing import get_args

import pytest

from eqllm import ConfigError, ModelConfig
from eqllm.config import RematPolicy, field_names
from eqllm.model import REMAT_POLICIES

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_model=30), "ModelConfig.n_heads=4 must divide d_model=30"),
        (dict(n_kv_heads=3), "ModelConfig.n_kv_heads=3 must divide n_heads=4"),
        (
            dict(norm="batchnorm"),
            "ModelConfig.norm='batchnorm' must be one of 'rmsnorm', 'layernorm'",
        ),
        (dict(n_layers=0), "ModelConfig.n_layers=0 must be positive"),
        (dict(vocab_size=-1), "ModelConfig.vocab_size=-1 must be positive"),
        (dict(d_model=36, n_heads=4, head_dim=9), "ModelConfig.head_dim=9 must be even"),
        (dict(d_model=12, n_heads=4), "ModelConfig.head_dim=3 must be even"),
        (dict(mlp="relu"), "ModelConfig.mlp='relu' must be one of 'gelu', 'swiglu', 'geglu'"),
        (dict(d_ff=64.0), "ModelConfig.d_ff=64.0 must be int"),
        (dict(d_ff="64"), "ModelConfig.d_ff='64' must be int"),
        (dict(n_layers=True), "ModelConfig.n_layers=True must be int"),
        (dict(tie_embeddings="yes"), "ModelConfig.tie_embeddings='yes' must be bool"),
        (dict(tie_embeddings=1), "ModelConfig.tie_embeddings=1 must be bool"),
        (dict(sliding_window=0), "ModelConfig.sliding_window=0 must be positive"),
        (dict(norm_eps=float("nan")), "ModelConfig.norm_eps=nan must be a finite number"),
        (dict(init_std=-0.1), "ModelConfig.init_std=-0.1 must be positive"),
        (dict(rope_scaling="yarn"), "ModelConfig.rope_scaling='yarn' must be one of"),
        (dict(rope_scaling="llama3", rope_factor=0.5), "ModelConfig.rope_factor=0.5 must be >= 1"),
        (dict(norm_bias=True), "ModelConfig.norm_bias=True is only defined for norm='layernorm'"),
        (dict(remat="some"), "ModelConfig.remat='some' must be one of 'none', 'full'"),
        (dict(family=""), "ModelConfig.family='' must be a non-empty string"),
        (dict(family=["llama"]), 'ModelConfig.family=["llama"] must be str'),
        (dict(d_modle=32), "unknown ModelConfig field 'd_modle'; did you mean 'd_model'?"),
    ],
)
def test_invalid_config_is_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**BASE, **overrides})
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_defaults_and_derived_sizes():
    cfg = ModelConfig(**BASE)
    assert cfg.n_kv_heads == 4 and cfg.head_dim == 8
    assert ModelConfig(**BASE, head_dim=16).head_dim == 16
    # A float field takes an int and stores a float (so TOML's 10000 equals 10000.0).
    assert ModelConfig(**BASE, rope_theta=500000).rope_theta == 500000.0


def test_family_is_any_non_empty_name():
    """The families registry validates family names; the config only needs a string."""
    assert ModelConfig(**BASE, family="some-new-family").family == "some-new-family"


def test_frozen_hashable_and_compared_by_value():
    """A config is a static field of the model and a jit cache key."""
    a, b = ModelConfig(**BASE), ModelConfig(**BASE)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != a.replace(n_layers=3)
    with pytest.raises(AttributeError):
        a.d_model = 64


def test_replace_validates_and_rederives_head_dim():
    cfg = ModelConfig(**BASE)
    assert cfg.replace(d_model=64).head_dim == 16  # derived head_dim follows d_model
    assert cfg.replace(n_heads=2).head_dim == 16
    assert cfg.replace(n_heads=2).n_kv_heads == 2  # multi-head attention stays multi-head
    assert ModelConfig(**BASE, n_kv_heads=2).replace(n_heads=8).n_kv_heads == 2
    explicit = ModelConfig(**BASE, head_dim=16)
    assert explicit.replace(d_model=64).head_dim == 16  # an explicit one stays
    assert cfg.replace(d_model=64, head_dim=32).head_dim == 32
    with pytest.raises(ConfigError, match="ModelConfig.n_layers=-1 must be positive"):
        cfg.replace(n_layers=-1)
    with pytest.raises(ConfigError) as info:
        cfg.replace(n_layer=3)
    message = str(info.value)
    assert "unknown ModelConfig field 'n_layer'; did you mean 'n_layers'?" in message
    assert "valid fields: vocab_size, d_model, n_layers" in message


def test_round_trip_through_dict():
    cfg = ModelConfig(**BASE, n_kv_heads=2, sliding_window=8)
    assert cfg.to_dict()["head_dim"] == 8
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert list(cfg.to_dict()) == field_names()
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"d_model": 32})
    assert str(info.value) == (
        "ModelConfig is missing required field(s) vocab_size, n_layers, n_heads, d_ff, max_seq_len"
    )
    with pytest.raises(ConfigError, match="unknown ModelConfig field 'dmodel'"):
        ModelConfig.from_dict({**BASE, "dmodel": 32})


def test_remat_policies_are_defined_once():
    """The model's policy table covers exactly the config's remat names other than "none"."""
    assert set(REMAT_POLICIES) == set(get_args(RematPolicy)) - {"none"}


def test_flops_per_token_hand_computed():
    """6N + 12 L H Q T for a config small enough to count by hand."""
    cfg = ModelConfig(**BASE)  # swiglu, untied, no GQA
    attn = 4 * 32 * 32
    mlp = 3 * 32 * 64
    n_matmul = 2 * (attn + mlp) + 32 * 64
    assert cfg.flops_per_token(16) == 6 * n_matmul + 12 * 2 * 4 * 8 * 16
