"""LoRA training on a mesh equals LoRA training on one device, and leaves the base in place."""

import jax
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.recipe import OptimSpec
from eqllm.sharding import batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.sharding.mesh import MeshConfig
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from tests.multidevice import CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)  # see test_train_mesh.py for eps


def train(mesh=None):
    base = eqllm.CausalLM(CFG, key=jax.random.key(0))
    model = lora.apply(base, rank=4, alpha=8, targets=["q_proj", "up_proj"], key=jax.random.key(1))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
    optimizer = make_optimizer(SPEC, 10, model)
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(SPEC, 10), param_shardings=shardings)
    losses = []
    for i in range(3):
        batch = jax.random.randint(jax.random.key(10 + i), (8, 33), 0, 96)
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return model, losses


def test_lora_on_a_mesh_equals_one_device():
    reference, ref_losses = train()
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    model, losses = train(mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    wrapped = model.blocks.attn.q_proj
    # The adapters follow their base's axes: B's output (heads) is split over `tensor`.
    assert "tensor" in str(wrapped.lora_b.weight.sharding.spec)
    np.testing.assert_allclose(
        np.asarray(wrapped.lora_b.weight),
        np.asarray(reference.blocks.attn.q_proj.lora_b.weight),
        atol=1e-5,
    )
    np.testing.assert_array_equal(
        np.asarray(wrapped.base.weight), np.asarray(reference.blocks.attn.q_proj.base.weight)
    )
