"""Pipeline parallelism on 8 simulated devices equals the plain step; checkpoints move across."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.runs import Checkpointer
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import Pipeline, TrainStep, init_opt_state, make_optimizer, mean_loss, schedule
from tests.multidevice import CFG
from tests.multidevice.test_train_mesh import SPEC

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

CFG4 = CFG.replace(n_layers=4)  # four layers: up to four stages
PIPE_MESHES = [("pipeline=2,data=2,fsdp=2", 2), ("pipeline=4,data=2", 4)]  # (mesh, microbatches)
STEPS = 2


def batches():
    return [jax.random.randint(jax.random.key(20 + i), (8, 33), 0, 96) for i in range(STEPS)]


def rel_close(got, want, rtol=1e-5):
    """Every leaf within rtol of the largest magnitude of its reference leaf."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * max(np.abs(b).max(), 1e-30))


def train(config, mesh=None, microbatches=1):
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    shardings, pipeline = None, None
    if mesh is not None:
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
        pipeline = Pipeline(mesh.shape["pipeline"], microbatches, mesh)
    optimizer = make_optimizer(SPEC, 10, eqx.filter(model, eqx.is_inexact_array))
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(SPEC, 10), param_shardings=shardings, pipeline=pipeline)
    losses = []
    for batch in batches():
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return model, opt_state, losses, step


@pytest.fixture(scope="module")
def reference():
    model, _, losses, _ = train(CFG4)
    return model, losses


@pytest.fixture(scope="module")
def pipelined():
    """mesh text -> (model, opt_state, losses, step) after STEPS pipelined steps (trained once)."""
    runs = {}

    def get(mesh_text, microbatches):
        if mesh_text not in runs:
            runs[mesh_text] = train(CFG4, make_mesh(MeshConfig.parse(mesh_text)), microbatches)
        return runs[mesh_text]

    return get


@pytest.mark.parametrize(("mesh_text", "microbatches"), PIPE_MESHES)
def test_pipelined_loss_and_gradients_equal_the_plain_ones(mesh_text, microbatches):
    model = eqllm.CausalLM(CFG4, key=jax.random.key(0))
    batch = batches()[0]
    want = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model, batch)
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    pipeline = Pipeline(mesh.shape["pipeline"], microbatches, mesh)
    model, batch = shard_model(model, mesh), jax.device_put(batch, batch_sharding(mesh))
    compiled = (
        eqx.filter_jit(eqx.filter_value_and_grad(pipeline.loss)).lower(model, batch).compile()
    )
    rel_close(compiled(model, batch), want)
    # The stages hand activations to their neighbours: XLA emits collective permutes.
    assert "collective-permute" in compiled.compiled.as_text()
    # The head's rows are spread over every device, the pipeline's included.
    hidden = eqx.filter_jit(pipeline.hidden)(model, batch[:, :-1])
    assert hidden.addressable_shards[0].data.shape[0] == batch.shape[0] // 8


@pytest.mark.slow  # the gradients above and the recipe run below cover the default suite
def test_pipelined_training_equals_single_device(reference, pipelined):
    ref_model, ref_losses = reference
    mesh_text, microbatches = PIPE_MESHES[0]
    model, _, losses, step = pipelined(mesh_text, microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    assert step.n_traces == 1
    q = model.blocks.attn.q_proj.weight  # (layers, heads, d_model): one stage per device group
    stages = int(mesh_text.split(",")[0].split("=")[1])
    assert q.sharding.spec[0] == "pipeline"
    assert q.addressable_shards[0].data.shape[0] == 4 // stages


def test_local_global_layers_and_remat_in_stages():
    """Gemma 2's per-layer window flags travel with their stage; remat recomputes inside it."""
    config = eqllm.zoo.config(
        "gemma2-nano",
        n_layers=4,
        vocab_size=96,
        max_seq_len=32,
        remat="full",
        attention={"sliding_window": 8},
    )
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    batch = batches()[0]
    want = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model, batch)
    mesh = make_mesh(MeshConfig.parse("pipeline=2,data=4"))
    pipeline = Pipeline(2, 2, mesh)
    got = eqx.filter_jit(eqx.filter_value_and_grad(pipeline.loss))(
        shard_model(model, mesh), jax.device_put(batch, batch_sharding(mesh))
    )
    rel_close(got, want)


def test_checkpoints_move_between_pipelined_and_plain_meshes(tmp_path):
    """The stacked layout [layers, ...] is the same on every mesh: only the placement differs."""
    template = eqllm.CausalLM(CFG4, key=jax.random.key(1))
    optimizer = make_optimizer(SPEC, 10, eqx.filter(template, eqx.is_inexact_array))
    plain_model = eqllm.CausalLM(CFG4, key=jax.random.key(0))
    mesh_a = make_mesh(MeshConfig.parse(PIPE_MESHES[0][0]))
    model = shard_model(plain_model, mesh_a)
    opt_state = init_opt_state(optimizer, model, param_shardings(model, mesh_a))
    ckpt = Checkpointer(tmp_path / "pipelined")
    ckpt.save(STEPS, model, opt_state, {"note": "pipeline=2"}, wait=True)

    def restore(checkpointer, target):
        t_model, shardings = template, None
        if target is not None:
            mesh = make_mesh(MeshConfig.parse(target))
            t_model, shardings = shard_model(template, mesh), param_shardings(template, mesh)
        restored, _, _ = checkpointer.restore(
            t_model, init_opt_state(optimizer, t_model, shardings)
        )
        q = restored.blocks.attn.q_proj.weight
        assert q.sharding.is_equivalent_to(t_model.blocks.attn.q_proj.weight.sharding, 3)
        return restored

    for target in ("pipeline=4,data=2", "data=8", None):
        for a, b in zip(
            jax.tree.leaves(restore(ckpt, target)), jax.tree.leaves(model), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
    # And the other way: saved without a pipeline, restored onto one.
    plain = Checkpointer(tmp_path / "plain")
    plain.save(STEPS, plain_model, init_opt_state(optimizer, plain_model), {}, wait=True)
    restored = restore(plain, "pipeline=4,data=2")
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(plain_model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain.close()


def test_a_recipe_runs_on_a_pipeline_mesh_and_prints_the_bubble(tmp_path, monkeypatch):
    from eqllm.recipe import RecipeError
    from eqllm.train import loop as loop_mod
    from tests.reliability.harness import make_corpus, tiny_recipe

    monkeypatch.setenv("EQLLM_CACHE", str(tmp_path / "cache"))
    recipe = tiny_recipe(tmp_path, make_corpus(tmp_path), steps=2, eval_every=0, microbatches=2)
    recipe = recipe.replace("mesh.pipeline", 2).replace("mesh.data", 4)
    too_many = recipe.replace("train.microbatches", 4)  # 2 rows per microbatch, 4 data devices
    model = eqllm.CausalLM(too_many.model_config(), key=jax.random.key(0))
    with pytest.raises(RecipeError, match="microbatches=4 = 2 rows per micro-batch do not split"):
        loop_mod.place_on_mesh(too_many, model)
    lines = []
    result = loop_mod.run(recipe, tmp_path / "run", progress=False, echo=lines.append)
    assert "pipeline: 2 stages x 1 layers, 2 microbatches, bubble fraction 0.333" in "\n".join(
        lines
    )
    assert result.summary["traces"] == 1 and result.summary["steps"] == 2
