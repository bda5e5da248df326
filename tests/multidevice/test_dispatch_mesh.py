"""Expert parallelism by token dispatch (`moe.impl="dispatch"`) on 8 devices: training with the
experts split over fsdp (data x fsdp, and data x fsdp x tensor) equals training on one device
for a Mixtral-style, a Qwen3-MoE, a DeepSeek-V3 and a Llama 4 tiny model; the compiled step
exchanges tokens by all-to-all and never gathers an expert's weights; capacity drops are
counted."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.bench.mesh import mesh_bench
from eqllm.nn import MoE
from eqllm.nn.dispatch import ExpertHooks, dispatched
from eqllm.recipe import OptimSpec
from eqllm.sharding import (
    MeshConfig,
    batch_sharding,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.sharding.dispatch import ExpertDispatch
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from tests.families import TINY_CONFIGS

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)  # see test_train_mesh.py
STEPS = 3
CONFIGS = {
    "mixtral": TINY_CONFIGS["mixtral"],
    "qwen3_moe": TINY_CONFIGS["qwen3_moe"],
    # the correction bias moves after each step, from the dispatched layers' routing
    "deepseek_v3": TINY_CONFIGS["deepseek_v3"].replace(
        moe={"bias_update_speed": 0.01, "aux_loss_coef": 0.01}
    ),
    # one expert a token, its input scaled by the score before it is sent (slow set)
    "llama4": TINY_CONFIGS["llama4"],
    # Gemma 4's dense MLP beside the experts, each normed; its router's own norm (slow set)
    "gemma4-moe": TINY_CONFIGS["gemma4-moe"],
}


def train(cfg, mesh=None):
    """STEPS AdamW steps from seed 0 (on `mesh`, or on one device): the model and the losses."""
    import eqllm

    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
    optimizer = make_optimizer(SPEC, 10, eqx.filter(model, eqx.is_inexact_array))
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(SPEC, 10), param_shardings=shardings)
    losses = []
    for i in range(STEPS):
        batch = jax.random.randint(jax.random.key(10 + i), (8, 33), 0, cfg.vocab_size)
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return model, losses


@functools.cache
def reference(family):
    return train(CONFIGS[family])  # dense experts on one device


@pytest.mark.slow  # about a minute each here; tests/test_dispatch.py runs them
@pytest.mark.parametrize("mesh_text", ["data=2,fsdp=4", "data=2,fsdp=2,tensor=2"])
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow) if f in ("llama4", "gemma4-moe") else f
        for f in sorted(CONFIGS)
    ],
)
def test_dispatched_training_equals_single_device(family, mesh_text):
    cfg = CONFIGS[family]
    ref_model, ref_losses = reference(family)
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    model, losses = train(cfg.replace(**{"moe.impl": "dispatch"}), mesh)
    assert model.blocks.mlp.gate.weight.sharding.spec[1] == "fsdp"  # experts split over fsdp
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Gemma 4's stack alone (no experts, plain FSDP) lands 1.0e-4 from one device after these
    # steps: its unscaled QK-normed scores amplify the fp32 reduction order (1.7e-4 with them).
    atol = 3e-4 if family == "gemma4-moe" else 2e-6
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)
    if family == "deepseek_v3":
        assert np.abs(np.asarray(model.blocks.mlp.score_bias)).max() > 0


def test_dispatched_step_exchanges_tokens_and_keeps_expert_weights_split():
    cfg = CONFIGS["qwen3_moe"].replace(scan_layers=True, **{"moe.impl": "dispatch"})
    result = mesh_bench("dispatch", cfg, "data=2,fsdp=4", batch=8, seq=32)
    e, f, d = cfg.moe.n_experts, cfg.moe.d_ff, cfg.d_model
    assert not {(e, f, d), (e, d, f)} & set(result.gathered_shapes)  # no expert gathered whole
    assert result.per_step["all-to-all"] > 0, result.per_step  # tokens there and back


def _layer(capacity_factor=None):
    moe = MoE(16, 8, 8, 2, impl="dispatch", capacity_factor=capacity_factor, key=jax.random.key(1))
    return jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), moe)


def test_dispatched_layer_equals_dense_and_counts_capacity_drops():
    """One layer on data=2,fsdp=4 (2 experts per device): dropless equals the dense product on
    one device; with a capacity of one fair share the dropped copies equal a hand count."""
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    run = ExpertDispatch(mesh)
    x = jax.random.normal(jax.random.key(3), (64, 16))  # 8 rows per device
    moe = _layer()
    _, weights, ids = moe.route(x)

    @jax.jit
    def both(moe, x):
        experts = (moe.gate, moe.up, moe.down)
        hooks = ExpertHooks(dispatch=run)
        return dispatched(experts, moe._act, x, weights, ids, moe.capacity_factor, hooks=hooks)

    out, dropped = both(moe, x)
    np.testing.assert_allclose(out, moe._dense(x, weights, ids), atol=1e-6)
    assert int(dropped) == 0

    # Capacity: each device sends each fsdp shard at most ceil(1.0 x 16 copies / 4) = 4 rows.
    out, dropped = both(_layer(1.0), x)
    ids_np = np.asarray(ids).reshape(8, 8 * 2)  # each device's 16 copies, device-major
    hand, keep = 0, np.zeros(ids_np.shape, bool)
    for r, copies in enumerate(ids_np):
        shards = np.bincount(copies // 2, minlength=4)  # copies for each fsdp shard's experts
        hand += np.maximum(shards - 4, 0).sum()
        seen = np.zeros(4, int)
        for c in np.argsort(copies, kind="stable"):  # kept: each shard's first 4 by expert
            keep[r, c] = seen[copies[c] // 2] < 4
            seen[copies[c] // 2] += 1
    assert int(dropped) == hand > 0
    kept_weights = jnp.where(keep.reshape(64, 2), weights, 0)
    np.testing.assert_allclose(out, moe._dense(x, kept_weights, ids), atol=1e-6)


def test_ungated_dispatched_layer_equals_dense_with_split_hidden_units():
    """Nemotron 3's ungated experts (no gate projection) on data=2,fsdp=2,tensor=2: the up
    projection's split hidden units (tensor) make the down projection a partial sum; the
    dispatched layer equals the dense product on one device."""
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    moe = jax.tree.map(
        lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape),
        MoE(16, 8, 8, 2, impl="dispatch", activation="relu2", key=jax.random.key(1)),
    )
    assert moe.gate is None
    x = jax.random.normal(jax.random.key(3), (64, 16))
    _, weights, ids = moe.route(x)

    @jax.jit
    def run(moe, x):
        hooks = ExpertHooks(dispatch=ExpertDispatch(mesh))
        return dispatched((moe.gate, moe.up, moe.down), moe._act, x, weights, ids, hooks=hooks)

    out, dropped = run(moe, x)
    np.testing.assert_allclose(out, moe._dense(x, weights, ids), atol=1e-6)
    assert int(dropped) == 0


def test_dropless_layer_blocks_hold_the_most_a_shard_can_receive():
    """Top 4 of 8 experts on fsdp=4 (2 per device): a token sends at most 2 of its 4 copies to
    one device, so each dropless block holds 2 rows per token, not 4. Every token choosing
    experts 0-3 (devices 0 and 1 get two copies of each token, the most possible) still
    equals the dense product, with nothing dropped."""
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    moe = jax.tree.map(
        lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape),
        MoE(16, 8, 8, 4, impl="dispatch", key=jax.random.key(1)),
    )
    x = jax.random.normal(jax.random.key(3), (64, 16))
    _, weights, _ = moe.route(x)
    order = jax.vmap(lambda k: jax.random.permutation(k, 4))(
        jax.random.split(jax.random.key(4), 64)
    )

    @jax.jit
    def run(moe, x, ids):
        hooks = ExpertHooks(dispatch=ExpertDispatch(mesh))
        return dispatched((moe.gate, moe.up, moe.down), moe._act, x, weights, ids, hooks=hooks)

    for ids in (order, moe.route(x)[2]):  # the worst case, and the router's own choice
        out, dropped = run(moe, x, ids)
        np.testing.assert_allclose(out, moe._dense(x, weights, ids), atol=1e-6)
        assert int(dropped) == 0
    text = run.lower(moe, x, order).compile().as_text()
    assert "f32[4,16,16]" in text and "f32[4,32,16]" not in text  # 8 tokens x 2 per block


def test_ragged_layer_on_each_devices_own_rows_equals_dense():
    """moe.impl "ragged" on data=2,fsdp=4 with 6 experts (which fsdp=4 does not split): each
    device runs the grouped matmul on its own 8 rows against every expert
    (`ExpertDispatch.own_rows`), with no exchange; output and gradients equal the dense
    product on one device."""
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    run = ExpertDispatch(mesh)
    moe = jax.tree.map(
        lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape),
        MoE(16, 8, 6, 2, impl="ragged", key=jax.random.key(1)),
    )
    x = jax.random.normal(jax.random.key(3), (64, 16))
    assert run.on_own_rows(moe, x) and not run.splits(moe, x)

    def loss(moe, x, impl=None, hooks=None):
        out = moe.routed(x, impl, hooks)[0]
        return jnp.sum(out * jnp.cos(out)), out

    hooks = ExpertHooks(dispatch=run.own_rows)
    own = jax.jit(jax.value_and_grad(lambda m, x: loss(m, x, hooks=hooks), has_aux=True))
    (value, out), grads = own(moe, x)
    dense = jax.value_and_grad(lambda m, x: loss(m, x, "dense"), has_aux=True)
    (ref_value, ref_out), ref_grads = dense(moe, x)
    np.testing.assert_allclose(out, ref_out, atol=1e-6)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    text = own.lower(moe, x).compile().as_text()
    assert "all-to-all" not in text


@pytest.mark.slow  # about a minute here
def test_ragged_training_on_own_rows_equals_single_device():
    """Mixtral-style tiny model, moe.impl "ragged" on data=2,fsdp=4: three steps equal dense
    experts on one device."""
    cfg = CONFIGS["mixtral"]
    ref_model, ref_losses = reference("mixtral")
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    model, losses = train(cfg.replace(**{"moe.impl": "ragged"}), mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.slow  # three runs of a tiny mixture of experts on 8 devices: about a minute or two
def test_stopped_and_resumed_dispatch_run_is_bit_exact(tmp_path, monkeypatch):
    """A run with the experts dispatched over data=2,fsdp=4 (with a capacity factor, so copies
    are dropped and counted), stopped after 3 of 6 steps and resumed, logs the same losses and
    dropped fractions and ends with the same weights as the run that was not stopped."""
    import json

    from eqllm.runs import RunFolder
    from eqllm.train import loop as loop_mod
    from tests.reliability.harness import make_corpus, tiny_recipe

    monkeypatch.setenv("EQLLM_CACHE", str(tmp_path / "cache"))
    recipe = tiny_recipe(
        tmp_path, make_corpus(tmp_path), steps=6, eval_every=6, checkpoint_every=3
    ).replace("model.variant", "olmoe-nano")
    for key, value in {
        "model.overrides.moe.n_experts": 8,
        "model.overrides.moe.impl": "dispatch",
        "model.overrides.moe.capacity_factor": 1.0,
        "mesh.data": 2,
        "mesh.fsdp": 4,
        "eval.sample_tokens": 0,
    }.items():
        recipe = recipe.replace(key, value)
    quiet = dict(progress=False, echo=lambda *a: None)
    whole = loop_mod.run(recipe, tmp_path / "a", final_eval=False, **quiet)
    first = loop_mod.run(recipe, tmp_path / "b", stop_after=3, **quiet)
    assert first.interrupted == "stop_after" and first.step == 3
    resumed = loop_mod.run(recipe, tmp_path / "b", resume=True, final_eval=False, **quiet)
    assert resumed.step == 6

    def logged(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["moe/dropped"]) for r in rows if "grad_norm" in r}

    assert logged(tmp_path / "a") == logged(tmp_path / "b")  # exact float equality
    assert len(logged(tmp_path / "a")) == 6
    assert any(dropped > 0 for _, dropped in logged(tmp_path / "a").values())  # drops happen
    assert whole.summary["experts"]["impl"] == "dispatch"
    assert whole.summary["experts"]["why"] == "set by moe.impl"
    a, _ = RunFolder(tmp_path / "a").load_model()
    b, _ = RunFolder(tmp_path / "b").load_model()
    for x, y in zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_array)),
        strict=True,
    ):
        assert np.array_equal(x, y)
