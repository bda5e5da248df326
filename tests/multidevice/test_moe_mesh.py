"""A mixture of experts trained with its experts split over the fsdp devices equals training
on one device (the `expert` axis maps to fsdp)."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.recipe import OptimSpec
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from tests.multidevice import CFG as DENSE

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

CFG = DENSE.replace(family="qwen2_moe", n_experts=4, moe_d_ff=32, shared_expert_d_ff=64)
CFG = CFG.replace(router_aux_loss_coef=0.01)
SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)  # see test_train_mesh.py


def train(mesh=None, impl="dense"):
    model = eqllm.CausalLM(CFG.replace(moe_impl=impl), key=jax.random.key(0))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
    optimizer = make_optimizer(SPEC, 10, eqx.filter(model, eqx.is_inexact_array))
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(SPEC, 10), param_shardings=shardings)
    losses = []
    for i in range(2):
        batch = jax.random.randint(jax.random.key(10 + i), (8, 33), 0, 96)
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append((float(metrics["loss"]), float(metrics["aux_loss"])))
    return model, losses


@pytest.fixture(scope="module")
def reference():
    return train()  # dense and grouped experts compute the same values (tests/test_moe.py)


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_expert_sharded_training_equals_single_device(reference, impl):
    ref_model, ref_losses = reference
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    model, losses = train(mesh, impl)
    spec = model.blocks.mlp.gate.weight.sharding.spec
    assert spec[1] == "fsdp"  # each device holds one expert
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
