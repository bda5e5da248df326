"""A mixture of experts in the pipeline schedule on 8 simulated devices equals one device.

Two stages, the experts split over fsdp inside each (pipeline x expert: `pipeline=2,fsdp=4`;
with data parallelism beside: `pipeline=2,data=2,fsdp=2`; with tensor parallelism too), for a
Mixtral-style model (softmax top 2, the switch balance loss) and a DeepSeek-V3 one (a dense
first layer before the stages, sigmoid group-limited routing with a moving correction bias, the
sequence-wise balance loss), and a hybrid with experts (Qwen3-Next: Gated DeltaNet and
attention layers, a group of each per stage), the experts computed densely or by token dispatch
(all-to-alls inside each stage): ten AdamW steps give the losses, balance losses and expert
loads of one device (dense experts)."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import Pipeline, TrainStep, init_opt_state, make_optimizer, schedule
from tests.multidevice.test_train_mesh import SPEC
from tests.test_pipeline import MOE_CONFIGS

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

STEPS = 10
METRICS = ("loss", "aux_loss", "expert_load")


def train(config, mesh_text=None, microbatches=2):
    """STEPS steps from seed 0, pipelined over `mesh_text` (or on one device): the model, each
    step's METRICS, the step, its optimizer state and last batch."""
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    mesh = shardings = pipeline = None
    if mesh_text is not None:
        mesh = make_mesh(MeshConfig.parse(mesh_text))
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
        pipeline = Pipeline(mesh.shape["pipeline"], microbatches, mesh)
    optimizer = make_optimizer(SPEC, STEPS, eqx.filter(model, eqx.is_inexact_array))
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(SPEC, STEPS), param_shardings=shardings, pipeline=pipeline)
    history = []
    for i in range(STEPS):
        batch = jax.random.randint(jax.random.key(30 + i), (8, 17), 0, 96)
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        history.append({k: np.asarray(metrics[k]) for k in METRICS})
    return model, history, step, opt_state, batch


@pytest.fixture(scope="module")
def reference():
    runs = {}

    def get(family):
        if family not in runs:
            runs[family] = train(MOE_CONFIGS[family])
        return runs[family]

    return get


# 20-60 s a case on this machine (10 steps on one device, once a family, then on the mesh): the
# default 8-device suite runs Mixtral's two, the slow set the rest.
CASES = [
    ("mixtral", "pipeline=2,fsdp=4", "dense"),
    ("mixtral", "pipeline=2,fsdp=4", "dispatch"),
    pytest.param("deepseek_v3", "pipeline=2,fsdp=4", "dense", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "pipeline=2,fsdp=4", "dispatch", marks=pytest.mark.slow),
    pytest.param("mixtral", "pipeline=2,data=2,fsdp=2", "dense", marks=pytest.mark.slow),
    pytest.param("mixtral", "pipeline=2,data=2,fsdp=2", "dispatch", marks=pytest.mark.slow),
    pytest.param("mixtral", "pipeline=2,fsdp=2,tensor=2", "dispatch", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "pipeline=2,data=2,fsdp=2", "dense", marks=pytest.mark.slow),
    pytest.param("qwen3_next", "pipeline=2,fsdp=4", "dense", marks=pytest.mark.slow),
    pytest.param("qwen3_next", "pipeline=2,fsdp=4", "dispatch", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "mesh_text", "impl"), CASES)
def test_pipelined_experts_train_as_on_one_device(reference, family, mesh_text, impl):
    ref_model, ref_history, *_ = reference(family)
    config = MOE_CONFIGS[family].replace(**{"moe.impl": impl})
    model, history, step, opt_state, batch = train(config, mesh_text)
    assert step.n_traces == 1
    if impl == "dispatch":  # each stage sends its tokens to their experts and back
        assert "all_to_all" in step.lower(model, opt_state, batch).as_text()
    for got, want in zip(history, ref_history, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["aux_loss"], want["aux_loss"], rtol=1e-5)
        np.testing.assert_array_equal(got["expert_load"], want["expert_load"])
    # The experts are not evenly loaded, so equal loads say the same experts were chosen.
    assert np.ptp(ref_history[0]["expert_load"]) > 0
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # Each device holds one stage's layers and its share of their experts.
    spec = model.blocks.mlp.gate.weight.sharding.spec  # (layers, experts, d_ff, d_model)
    assert spec[0] == "pipeline" and spec[1] == "fsdp"
    if family == "deepseek_v3":  # the correction bias moved, the same way in the stages
        bias = np.asarray(model.blocks.mlp.score_bias)
        assert np.abs(bias).max() > 0
        np.testing.assert_allclose(bias, np.asarray(ref_model.blocks.mlp.score_bias), atol=1e-7)
