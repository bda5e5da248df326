"""muP and CompleteP: roles from the layers' metadata, the multipliers' table, bit-identity with
SP at the base size, and what changes away from it."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.errors import EqllmError
from eqllm.nn import param_info
from eqllm.parametrization import Multipliers, role_multipliers, scales
from eqllm.recipe import OptimSpec
from eqllm.train.optim import MUON_AXES, make_optimizer, parameter_groups, schedule
from eqllm.train.step import TrainStep, init_opt_state

# One learning rate throughout the step: no warmup, no decay, no clipping.
FLAT = dict(schedule="constant", warmup_steps=0, clip_norm=0.0)
BASE = eqllm.zoo.config(
    "llama-nano",
    d_model=32,
    n_layers=2,
    attention={"n_heads": 2, "n_kv_heads": 2},
    mlp={"d_ff": 64},
    vocab_size=97,
    max_seq_len=32,
)


def train(cfg, steps=3, lr=1e-2):
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    first = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    spec = OptimSpec(lr=lr, warmup_steps=0, weight_decay=0.1)
    optimizer = make_optimizer(spec, 20, model)
    step = TrainStep(optimizer, schedule(spec, 20))
    state = init_opt_state(optimizer, model)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 17)), jnp.int32)
    losses = []
    for _ in range(steps):
        model, state, metrics = step(model, state, batch)
        losses.append(float(metrics["loss"]))
    return first, losses


def test_roles_come_from_the_layers_axes():
    model = eqllm.CausalLM(BASE.replace(tie_embeddings=False), key=jax.random.key(0))
    info = param_info(model)
    assert info.embed.weight.role == "embedding"
    assert info.lm_head.weight.role == "readout"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(info.blocks.attn, name).weight.role == "hidden"
    assert info.blocks.mlp.down.weight.role == "hidden"
    assert info.final_norm.weight.role == "vector"


@pytest.mark.parametrize("kind", ["mup", "completep"])
def test_multipliers_follow_the_table(kind):
    # docs/scaling-laws.md's table, at width ratio m = 4 and depth ratio k = 2.
    cfg = BASE.replace(
        d_model=128,
        **{"attention.n_heads": 2, "attention.n_kv_heads": 2, "mlp.d_ff": 256},
        n_layers=4,
        parametrization=kind,
        base_d_model=32,
        base_n_layers=2,
        output_mult=2.0,
    )
    s = scales(cfg)
    m, k = 4.0, (2.0 if kind == "completep" else 1.0)
    assert (s.width, s.depth) == (m, k)
    assert s.readout == pytest.approx(2.0 / m)
    assert s.branch == pytest.approx(1 / k)
    assert s.attention == pytest.approx(1 / math.sqrt(m))  # head_dim grows 16 -> 64
    assert s.residual_init_layers == (2 if kind == "completep" else 4)
    eps = 1 / m if kind == "mup" else 1 / (m * k)
    assert role_multipliers(s, "hidden") == Multipliers(1 / math.sqrt(m), 1 / m, eps, m)
    for role in ("embedding", "readout", "vector"):
        assert role_multipliers(s, role) == Multipliers()
    # The optimizer's groups carry the same factors.
    labels, factors = parameter_groups(eqllm.CausalLM(cfg, key=jax.random.key(0)))
    assert factors["hidden"].lr == pytest.approx(1 / m)
    assert labels.blocks.attn.q_proj.weight == "hidden" and labels.embed.weight == "embedding"


def test_each_optimizer_takes_its_own_hidden_factor():
    # With m = 4: an entrywise-normalised step (AdamW, Lion) moves an output by lr x fan_in, so
    # lr / m; Adafactor's step is lr x RMS(W), which the init already shrinks by 1 / sqrt(m);
    # Muon's orthogonalised step has spectral norm lr x 0.2 sqrt(max(fan_in, fan_out))
    # ("match_rms_adamw", growing as sqrt(m)) or lr x sqrt(max(1, fan_out / fan_in)) ("original",
    # flat). Decay per step (lr x wd) stays put; every other role keeps factor 1.
    s = scales(BASE.replace(d_model=128, parametrization="mup", base_d_model=32))
    init = 1 / math.sqrt(4)
    expected = {
        "adam": Multipliers(init, 1 / 4, 1 / 4, 4.0),
        "relative": Multipliers(init, 1 / 2, 1.0, 2.0),
        "spectral": Multipliers(init, 1.0, 1.0, 1.0),
        "spectral_rms": Multipliers(init, 1 / 2, 1.0, 2.0),
    }
    for update, factors in expected.items():
        assert role_multipliers(s, "hidden", update) == factors
        assert role_multipliers(s, "readout", update) == Multipliers()
    with pytest.raises(EqllmError, match="update='sgd'"):
        role_multipliers(s, "hidden", "sgd")


@pytest.mark.parametrize(("muon_scale", "factor"), [("match_rms_adamw", 0.5), ("original", 1.0)])
def test_muon_matrices_take_the_spectral_factor(muon_scale, factor):
    # One Muon step of a muP model at m = 4 on a hidden matrix equals optax's own Muon at
    # lr x factor on that matrix alone (1 / sqrt(4) under "match_rms_adamw", 1 under "original").
    cfg = BASE.replace(d_model=128, parametrization="mup", base_d_model=32)
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    spec = OptimSpec(name="muon", lr=0.02, muon_scale=muon_scale, weight_decay=0.0, **FLAT)
    optimizer = make_optimizer(spec, 10, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(
        lambda x: jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape), params
    )
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    w = lambda t: t.blocks.mlp.up.weight  # noqa: E731
    reference = optax.contrib.muon(
        0.02 * factor,
        beta=spec.muon_momentum,
        ns_steps=spec.muon_ns_steps,
        muon_weight_dimension_numbers=MUON_AXES,
        consistent_rms=0.2 if muon_scale == "match_rms_adamw" else None,
    )
    expected, _ = reference.update(w(grads), reference.init(w(params)), w(params))
    np.testing.assert_allclose(w(updates), expected, rtol=1e-5, atol=1e-7)


def test_init_std_follows_width_and_depth():
    wide = BASE.replace(d_model=128, n_layers=8, **{"mlp.d_ff": 256})
    sp = eqllm.CausalLM(wide, key=jax.random.key(1))
    mup = eqllm.CausalLM(
        wide.replace(parametrization="mup", base_d_model=32), key=jax.random.key(1)
    )
    cp = eqllm.CausalLM(
        wide.replace(parametrization="completep", base_d_model=32, base_n_layers=2),
        key=jax.random.key(1),
    )
    std = lambda x: float(jnp.std(x))  # noqa: E731
    q = lambda m: m.blocks.attn.q_proj.weight  # noqa: E731
    o = lambda m: m.blocks.attn.o_proj.weight  # noqa: E731
    assert std(q(mup)) == pytest.approx(std(q(sp)) / 2, rel=0.03)  # 1 / sqrt(4)
    assert std(mup.embed.weight) == pytest.approx(std(sp.embed.weight), rel=1e-6)
    # CompleteP's residual role: 0.02 / sqrt(2 * base_n_layers) / sqrt(m), not / sqrt(2 * 8).
    assert std(o(cp)) == pytest.approx(0.02 / math.sqrt(4) / 2, rel=0.03)
    assert std(o(mup)) == pytest.approx(0.02 / math.sqrt(16) / 2, rel=0.03)


@pytest.mark.parametrize(
    "changes",
    [
        {"parametrization": "mup", "base_d_model": 32},
        # base: the model's own width
        pytest.param({"parametrization": "mup"}, marks=pytest.mark.slow),
        pytest.param(
            {"parametrization": "completep", "base_d_model": 32, "base_n_layers": 2},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_base_size_equals_sp_bit_for_bit(changes):
    first_sp, losses_sp = train(BASE)
    first, losses = train(BASE.replace(**changes))
    assert all(np.array_equal(a, b) for a, b in zip(first_sp, first, strict=True))
    assert losses == losses_sp  # exactly, step after step


def test_wider_mup_model_changes_what_it_should():
    cfg = BASE.replace(d_model=64, parametrization="mup", base_d_model=32, **{"mlp.d_ff": 128})
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    skeleton = eqx.filter_eval_shape(
        eqllm.CausalLM, cfg.replace(parametrization="sp"), key=jax.random.key(0)
    )
    sp = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))
    tokens = jnp.arange(10) % 97
    # Same weights: the readout multiplier halves the logits (no attention in one token).
    one = tokens[:1]
    np.testing.assert_allclose(model(one), sp(one) / 2, rtol=1e-5, atol=1e-7)


def test_parametrization_is_refused_for_experts():
    with pytest.raises(ConfigError, match="parametrization"):
        eqllm.zoo.config("mixtral-nano", parametrization="mup")


def test_export_folds_the_multipliers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = BASE.replace(
        d_model=64,
        n_layers=4,
        **{"mlp.d_ff": 128},
        tie_embeddings=False,
        parametrization="completep",
        base_d_model=32,
        base_n_layers=2,
        output_mult=2.0,
    )
    s = scales(cfg)
    assert (s.readout, s.branch, s.attention) != (1.0, 1.0, 1.0)
    model = eqllm.CausalLM(cfg, key=jax.random.key(3))
    eqllm.hub.save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 97, 24)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens[None])).logits[0].numpy()
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    # And SP's logits differ: the multipliers matter.
    assert not np.allclose(
        np.asarray(
            eqllm.CausalLM(cfg.replace(parametrization="sp"), key=jax.random.key(3))(
                jnp.asarray(tokens)
            )
        ),
        ours,
        atol=1e-3,
    )


def test_export_refuses_a_tied_head_with_an_output_multiplier(tmp_path):
    cfg = BASE.replace(
        d_model=64,
        tie_embeddings=True,
        parametrization="mup",
        base_d_model=32,
        **{"mlp.d_ff": 128},
    )
    with pytest.raises(EqllmError, match="untie"):
        eqllm.hub.save_pretrained(eqllm.CausalLM(cfg, key=jax.random.key(0)), tmp_path)


def test_a_recipe_names_its_parametrization():
    from eqllm.recipe import Recipe

    recipe = Recipe.from_dict(
        {
            "model": {
                "variant": "llama-nano",
                "parametrization": "mup",
                "overrides": {"d_model": 256, "base_d_model": 128},
            },
            "train": {"steps": 1},
        }
    )
    cfg = recipe.model_config()
    assert (cfg.parametrization, cfg.base_d_model) == ("mup", 128)
    assert scales(cfg).width == 2.0
