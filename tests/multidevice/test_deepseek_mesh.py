"""A tiny DeepSeek-V3 (latent attention, a dense first layer, sigmoid routing with a moving
correction bias over groups of experts) and a tiny gpt-oss (attention sinks, windowed and full
layers, biased clamped experts) trained on 8 devices, split over data, fsdp (experts) and
tensor (heads), equal training on one device."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.recipe import OptimSpec
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)  # see test_train_mesh.py
SMALL = dict(vocab_size=96, d_model=64, max_seq_len=32, n_layers=2)
CONFIGS = {
    "deepseek_v3": eqllm.zoo.config(
        "deepseek_v3-nano",
        **SMALL,
        moe={"bias_update_speed": 0.01, "aux_loss_coef": 0.01},
    ),
    "gpt_oss": eqllm.zoo.config(
        "gpt_oss-nano",
        **SMALL,
        attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "sliding_window": 8},
        moe={"n_experts": 4, "d_ff": 32},
    ),
}


def train(cfg, mesh=None):
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
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


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_mesh_training_equals_single_device(family):
    cfg = CONFIGS[family]
    ref_model, ref_losses = train(cfg)
    model, losses = train(cfg, make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2")))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    if family == "deepseek_v3":  # the correction bias moved, the same way on the mesh
        assert np.abs(np.asarray(model.blocks.mlp.score_bias)).max() > 0
