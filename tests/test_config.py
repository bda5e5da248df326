"""ModelConfig validation: every bad value is refused with one line naming field, value and rule."""

from typing import get_args

import pytest

from eqllm import ConfigError, ModelConfig
from eqllm.config import RematPolicy, field_names
from eqllm.model import REMAT_POLICIES

BASE = {
    "vocab_size": 64,
    "d_model": 32,
    "n_layers": 2,
    "attention.n_heads": 4,
    "mlp.d_ff": 64,
    "max_seq_len": 16,
}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_model=30), "ModelConfig.attention.n_heads=4 must divide d_model=30"),
        (
            {"attention.n_kv_heads": 3},
            "ModelConfig.attention.n_kv_heads=3 must divide n_heads=4",
        ),
        (
            {"norms.kind": "batchnorm"},
            "ModelConfig.norms.kind='batchnorm' must be one of 'rmsnorm', 'layernorm'",
        ),
        (dict(n_layers=0), "ModelConfig.n_layers=0 must be positive"),
        (dict(vocab_size=-1), "ModelConfig.vocab_size=-1 must be positive"),
        (
            {"d_model": 36, "attention.n_heads": 4, "attention.head_dim": 9},
            "ModelConfig.attention.head_dim=9 must be even",
        ),
        (
            {"d_model": 12, "attention.n_heads": 4},
            "ModelConfig.attention.head_dim=3 must be even",
        ),
        (
            {"mlp.kind": "relu"},
            "ModelConfig.mlp.kind='relu' must be one of 'gelu', 'swiglu', 'geglu'",
        ),
        ({"mlp.d_ff": 64.0}, "ModelConfig.mlp.d_ff=64.0 must be int"),
        ({"mlp.d_ff": "64"}, "ModelConfig.mlp.d_ff='64' must be int"),
        (dict(n_layers=True), "ModelConfig.n_layers=True must be int"),
        (dict(tie_embeddings="yes"), "ModelConfig.tie_embeddings='yes' must be bool"),
        (dict(tie_embeddings=1), "ModelConfig.tie_embeddings=1 must be bool"),
        (
            {"attention.sliding_window": 0},
            "ModelConfig.attention.sliding_window=0 must be positive",
        ),
        ({"norms.eps": float("nan")}, "ModelConfig.norms.eps=nan must be a finite number"),
        (dict(init_std=-0.1), "ModelConfig.init_std=-0.1 must be positive"),
        (
            {"positions.scaling.kind": "warp"},
            "ModelConfig.positions.scaling.kind='warp' must be one of",
        ),
        (
            {
                "positions.scaling": {
                    "kind": "llama3",
                    "factor": 0.5,
                    "original_max_seq_len": 8192,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                }
            },
            "ModelConfig.positions.scaling.factor=0.5 must be >= 1",
        ),
        (
            {"norms.bias": True},
            "ModelConfig.norms.bias=True is only defined for kind='layernorm'",
        ),
        (dict(remat="some"), "ModelConfig.remat='some' must be one of 'none', 'full'"),
        (dict(family=""), "ModelConfig.family='' must be a non-empty string"),
        (dict(family=["llama"]), 'ModelConfig.family=["llama"] must be str'),
        (dict(d_modle=32), "unknown ModelConfig field 'd_modle'; did you mean 'd_model'?"),
        (
            {"attention.n_head": 4},
            "unknown ModelConfig.attention field 'n_head'; did you mean 'n_heads'?",
        ),
        (dict(attention=4), "ModelConfig.attention=4 must be a table"),
        ({"attention.qk_norm": True}, "ModelConfig.attention.qk_norm=True must be one of"),
        (
            {"moe.n_experts": 2, "moe.experts_per_token": 3},
            "ModelConfig.moe.experts_per_token=3 must be <= n_experts=2",
        ),
    ],
)
def test_invalid_config_is_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**BASE, **overrides})
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_defaults_and_derived_sizes():
    cfg = ModelConfig(**BASE)
    assert cfg.attention.n_kv_heads == 4 and cfg.head_dim == 8
    assert ModelConfig(**BASE, **{"attention.head_dim": 16}).head_dim == 16
    # A float field takes an int and stores a float (so TOML's 10000 equals 10000.0).
    assert ModelConfig(**BASE, **{"positions.theta": 500000}).positions.theta == 500000.0


def test_a_missing_feature_is_none():
    """A dense model has no `moe` group; plain RoPE has no `scaling`; groups nest as dicts."""
    cfg = ModelConfig(**BASE)
    assert cfg.moe is None and cfg.positions.scaling is None
    moe = cfg.replace(moe={"n_experts": 4})
    assert moe.moe.n_experts == 4 and moe.expert_d_ff == 64
    assert moe.at("moe.n_experts") == 4 and cfg.at("moe.n_experts") is None
    assert moe.replace(moe=None) == cfg
    # A dict for a group changes only the fields it names; a dotted key the same.
    assert cfg.replace(attention={"n_kv_heads": 2}) == cfg.replace(**{"attention.n_kv_heads": 2})
    assert cfg.replace(attention={"n_kv_heads": 2}).attention.n_heads == 4


def test_family_is_any_non_empty_name():
    """The families registry validates family names; the config only needs a string."""
    assert ModelConfig(**BASE, family="some-new-family").family == "some-new-family"


def test_frozen_hashable_and_compared_by_value():
    """A config is a static field of the model and a jit cache key."""
    a, b = ModelConfig(**BASE), ModelConfig(**BASE)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != a.replace(n_layers=3)
    assert a != a.replace(**{"attention.n_kv_heads": 2})
    with pytest.raises(AttributeError):
        a.d_model = 64
    with pytest.raises(AttributeError):
        a.attention.n_heads = 8


def test_replace_validates_and_rederives_head_dim():
    cfg = ModelConfig(**BASE)
    assert cfg.replace(d_model=64).head_dim == 16  # derived head_dim follows d_model
    assert cfg.replace(attention={"n_heads": 2}).head_dim == 16
    # multi-head attention stays multi-head
    assert cfg.replace(attention={"n_heads": 2}).attention.n_kv_heads == 2
    gqa = ModelConfig(**BASE, **{"attention.n_kv_heads": 2})
    assert gqa.replace(attention={"n_heads": 8}).attention.n_kv_heads == 2
    explicit = ModelConfig(**BASE, **{"attention.head_dim": 16})
    assert explicit.replace(d_model=64).head_dim == 16  # an explicit one stays
    assert cfg.replace(d_model=64, attention={"head_dim": 32}).head_dim == 32
    with pytest.raises(ConfigError, match="ModelConfig.n_layers=-1 must be positive"):
        cfg.replace(n_layers=-1)
    with pytest.raises(ConfigError) as info:
        cfg.replace(n_layer=3)
    message = str(info.value)
    assert "unknown ModelConfig field 'n_layer'; did you mean 'n_layers'?" in message
    assert "valid fields: vocab_size, d_model, n_layers" in message
    with pytest.raises(ConfigError, match="unknown ModelConfig.norms field 'epsilon'"):
        cfg.replace(**{"norms.epsilon": 1e-6})


def test_round_trip_through_dict():
    cfg = ModelConfig(**BASE, **{"attention.n_kv_heads": 2, "attention.sliding_window": 8})
    assert cfg.to_dict()["attention"]["head_dim"] == 8
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert list(cfg.to_dict()) == field_names()
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"d_model": 32})
    assert str(info.value) == (
        "ModelConfig is missing required field(s) vocab_size, n_layers, max_seq_len, attention, mlp"
    )
    with pytest.raises(ConfigError) as info:
        sizes = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "max_seq_len": 16}
        ModelConfig.from_dict({**sizes, "mlp": {"d_ff": 64}, "attention": {"n_kv_heads": 2}})
    assert str(info.value) == "ModelConfig.attention is missing required field(s) n_heads"
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


def test_the_earlier_flat_layout_still_reads():
    """Run and model folders written before the groups hold flat configs."""
    flat = dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        max_seq_len=16,
        family="olmo2",
        norm="rmsnorm",
        norm_eps=1e-6,
        qk_norm=True,
        qk_norm_per_head=False,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=16,
        n_experts=None,
        experts_per_token=2,
        moe_impl="dense",
        attention="xla",
    )
    scaling = dict(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_seq_len=16,
    )
    expected = ModelConfig(
        **BASE,
        family="olmo2",
        **{
            "attention.n_kv_heads": 2,
            "attention.qk_norm": "whole",
            "attention.kernel": "xla",
            "norms.eps": 1e-6,
            "positions.scaling": scaling,
        },
    )
    assert ModelConfig.from_dict(flat) == expected
    moe = ModelConfig.from_dict({**flat, "n_experts": 4, "moe_impl": "ragged"})
    assert moe.moe.n_experts == 4 and moe.moe.impl == "ragged"
