"""Expert parallelism by token dispatch (`moe.impl="dispatch"`): on one device it equals the
dense experts for every routing the zoo has; on 8 simulated devices (a subprocess, as
tests/test_sharding.py runs them) the dispatched layer equals the dense one and counts its
capacity drops by hand, and training equals one device (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.config.experts import choose_kernel
from eqllm.nn import ExpertLinear, MoE
from eqllm.nn.grouped import megablox_matmul, tiling
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train.step import training_loss
from tests.families import TINY_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
KEY = jax.random.key(0)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 17)).astype(np.int32)


@eqx.filter_jit
def _loss_and_grads(model, tokens):
    return eqx.filter_value_and_grad(lambda m: training_loss(m, tokens)[0])(model)


def _perturbed(model):
    """Random weights everywhere (the correction bias included), so no routing is tied."""
    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_inexact_array))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [
        x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, noisy), model)


ROUTINGS = {
    "mixtral": dict(),  # softmax top-k renormalised
    "qwen_moe": dict(normalize=False, shared_d_ff=16),  # not renormalised, gated shared expert
    "deepseek_v3": dict(  # sigmoid scores, correction bias, groups, routed scale, plain shared
        scoring="sigmoid",
        score_bias=True,
        n_groups=4,
        topk_groups=2,
        group_score="top2_sum",
        routed_scale=2.5,
        shared_d_ff=16,
        shared_gated=False,
    ),
    "gpt_oss": dict(bias=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=0.5),
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_dispatched_layer_equals_dense_one(routing):
    """Output and gradients of one layer on one device: the dispatch (one shard, no exchange)
    equals the dense product for every routing `MoE.route` computes before it."""
    moe = _perturbed(MoE(16, 24, 8, 2, impl="dispatch", key=jax.random.key(0), **ROUTINGS[routing]))
    x = jax.random.normal(jax.random.key(1), (3, 5, 16))

    @eqx.filter_jit
    def value_and_grads(moe, impl):
        return jax.value_and_grad(lambda m: (m.routed(x, impl)[0] ** 2).sum())(moe)

    loss, grads = value_and_grads(moe, "dense")
    other_loss, other_grads = value_and_grads(moe, "dispatch")
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_megablox_grouped_matmul_equals_ragged_dot_with_its_gradients():
    """The TPU kernel (`moe.kernel="megablox"`, run in Pallas' interpreter here) gives
    ragged_dot's rows, padding rows past the groups included, and the same gradients with
    respect to the rows, the expert weights (its grouped weight gradient, tgmm) and biases."""
    lin = _perturbed(ExpertLinear(3, 16, 24, axes=("d_ff", "d_model"), use_bias=True, key=KEY))
    x = jax.random.normal(jax.random.key(1), (20, 16))
    sizes = jnp.array([3, 0, 12])  # 15 rows in groups (the middle expert gets none), 5 padding
    dy = jax.random.normal(jax.random.key(2), (20, 24))

    def loss(kernel):
        def f(lin, x):
            y = lin.grouped(x, sizes, kernel, interpret=kernel == "megablox")
            return (y * dy).sum(), y

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(lin, x)

    (value, y), grads = loss("xla")
    (other_value, other_y), other_grads = loss("megablox")
    np.testing.assert_allclose(other_y, y, atol=1e-5)
    np.testing.assert_allclose(other_value, value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert np.abs(np.asarray(grads[0].weight[1])).max() == 0  # no rows, no gradient


def test_megablox_tiles_are_large_and_uneven_dimensions_still_exact():
    """Tiles of up to 512 rows by 1024 x 1024 (small tiles re-read the rows and weights from
    HBM once per tile); a dimension no tile divides takes an uneven last tile, and the kernels
    still give ragged_dot's product and weight gradient."""
    assert tiling(65536, 7168, 2048) == (512, 1024, 1024)
    assert tiling(20, 16, 24) == (4, 16, 24)
    assert tiling(4096, 1280, 1100) == (512, 256, 128)
    x = jax.random.normal(jax.random.key(1), (64, 1280))
    w = jax.random.normal(jax.random.key(2), (2, 1100, 1280)) / 32
    sizes = jnp.array([40, 24])

    def loss(kernel):
        def f(w):
            if kernel == "megablox":
                y = megablox_matmul(x, w, sizes, interpret=True)
            else:
                y = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes)
            return (y * y).sum() / 2, y

        return jax.value_and_grad(f, has_aux=True)(w)

    (_, y), grad = loss("xla")
    (_, other_y), other_grad = loss("megablox")
    np.testing.assert_allclose(other_y, y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(other_grad, grad, rtol=1e-4, atol=1e-3)


def test_moe_kernel_auto_is_megablox_on_tpu_only_where_nothing_partitions_it():
    """megablox (a Pallas kernel) runs inside the dispatch's shard_map or on one device: the
    compiler cannot split it over a mesh."""
    assert choose_kernel("auto", backend="tpu", impl="ragged") == "megablox"  # one device
    assert choose_kernel("auto", backend="tpu", impl="dispatch", devices=8, expert_shards=4) == (
        "megablox"
    )
    assert choose_kernel("auto", backend="tpu", impl="ragged", devices=8) == "xla"
    assert choose_kernel("auto", backend="tpu", impl="ragged", devices=8, expert_shards=2) == (
        "megablox"  # each device's own rows inside shard_map
    )
    assert choose_kernel("auto", backend="tpu", impl="dispatch", devices=8) == "xla"  # 1 shard
    cpu, gpu = (choose_kernel("auto", backend=b, impl="ragged") for b in ("cpu", "gpu"))
    assert cpu == gpu == "xla"
    assert choose_kernel("xla", backend="tpu", impl="ragged") == "xla"
    with pytest.raises(ConfigError, match="moe.kernel='megablox' with moe.impl='ragged' on 8 dev"):
        choose_kernel("megablox", backend="tpu", impl="ragged", devices=8)
    with pytest.raises(ValueError, match="MoE kernel must be 'xla' or 'megablox'"):
        MoE(16, 24, 8, 2, impl="ragged", kernel="pallas", key=KEY)


@pytest.mark.slow  # the whole model of each family: 20-60 s each here
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_dispatched_models_equal_dense_ones(family):
    """Loss and gradients of a whole tiny model on one device, dispatch against dense."""
    dense = _perturbed(eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(0)))
    dispatch = dense.with_config(moe={"impl": "dispatch"})
    loss, grads = _loss_and_grads(dense, TOKENS)
    other_loss, other_grads = _loss_and_grads(dispatch, TOKENS)
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_capacity_factor_needs_the_dispatch():
    with pytest.raises(ConfigError, match="moe.capacity_factor=1.25 is only read by impl='disp"):
        TINY_CONFIGS["mixtral"].replace(moe={"capacity_factor": 1.25})
    cfg = TINY_CONFIGS["mixtral"].replace(moe={"impl": "dispatch", "capacity_factor": 1.25})
    assert eqllm.CausalLM(cfg, key=jax.random.key(0)).blocks.mlp.capacity_factor == 1.25


def test_dropped_copies_are_a_training_metric():
    """With a capacity factor, the train step reports moe/dropped: the fraction of token copies
    dropped past the capacity, over every expert layer. On one device the dispatch has one
    shard and no exchange, but the capacity still applies: a slot of ceil(c x copies) rows, so
    a factor below 1 drops copies - slot of every layer's copies (a hand count)."""
    cfg = TINY_CONFIGS["mixtral"].replace(moe={"impl": "dispatch", "capacity_factor": 0.6})
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    spec = OptimSpec(lr=1e-3, warmup_steps=0)
    optimizer = make_optimizer(spec, 4, eqx.filter(model, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 4))
    routing = eqx.filter_jit(lambda m, t: m.routing(t)[1])(model, np.asarray(TOKENS))
    _, _, metrics = step(model, init_opt_state(optimizer, model), np.asarray(TOKENS))  # donates
    copies = TOKENS.shape[0] * (TOKENS.shape[1] - 1) * cfg.moe.experts_per_token  # per layer
    slot = -(-6 * copies // 10)  # ceil(0.6 x copies)
    np.testing.assert_allclose(float(metrics["moe/dropped"]), (copies - slot) / copies)
    n_moe = cfg.n_layers - cfg.moe.dense_layers
    whole = TOKENS.size * cfg.moe.experts_per_token  # all 17 positions here
    np.testing.assert_array_equal(routing.dropped, [whole - -(-6 * whole // 10)] * n_moe)
    dropless = TINY_CONFIGS["mixtral"].replace(moe={"impl": "dispatch"})
    parts = training_loss(eqllm.CausalLM(dropless, key=jax.random.key(0)), jnp.asarray(TOKENS))[1]
    assert "moe/dropped" not in parts and "expert_load" in parts


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_the_expert_load_is_the_routed_ids_counts(family):
    """The step's expert_load is counted once, from the ids each layer routed (and dispatched)
    with: it equals a second top-k over the router logits under the layer's own routing
    (DeepSeek's correction bias and groups included), and every layer sums to 1."""
    from eqllm.nn import chosen_load
    from eqllm.train.balance import balance_terms

    cfg = TINY_CONFIGS[family].replace(moe={"impl": "dispatch", "capacity_factor": 0.6})  # drops
    model = _perturbed(eqllm.CausalLM(cfg, key=jax.random.key(0)))
    routing = eqx.filter_jit(lambda m, t: m.routing(t)[1])(model, jnp.asarray(TOKENS))
    load = balance_terms(model, routing)["expert_load"]
    np.testing.assert_allclose(load, chosen_load(model.blocks.mlp, routing.logits), rtol=1e-6)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)
    assert (
        routing.load.sum()
        == routing.load.shape[0] * TOKENS.size * model.config.moe.experts_per_token
    )


def _on_8_devices(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "EQLLM_MULTIDEVICE": "1",
        "JAX_PLATFORMS": "cpu",
    }
    test = ROOT / "tests" / "multidevice" / "test_dispatch_mesh.py"
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    return subprocess.run(
        [*command, str(test)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200
    )


def test_dispatched_layer_on_8_devices_equals_dense_and_counts_drops():
    """About 30 s: one layer's all-to-all dispatch on data=2,fsdp=4 (tests/multidevice):
    dropless at the worst case, with capacity drops counted, ungated experts (Nemotron 3)
    whose hidden units tensor splits, and a grouped layer on each device's own rows."""
    result = _on_8_devices("-k", "layer")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow  # about 10 minutes on 2 shared cores: 6 trainings on 8 devices, 3 on one,
# and a run stopped and resumed with the dispatch (bit-exact)
def test_dispatched_training_on_8_devices_equals_one_device():
    result = _on_8_devices("-m", "slow or not slow")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]
