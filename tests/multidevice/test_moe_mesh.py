"""A mixture of experts trained with its experts split over the fsdp devices equals training
on one device (the `expert` axis maps to fsdp), and the dense experts run expert-parallel: the
compiled step moves tokens, never an expert's weights."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.bench.mesh import mesh_bench
from eqllm.recipe import OptimSpec
from eqllm.sharding import (
    MeshConfig,
    batch_sharding,
    fsdp_gather,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from tests.multidevice import CFG as DENSE

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

CFG = DENSE.replace(
    family="qwen2_moe", moe={"n_experts": 4, "d_ff": 32, "shared_d_ff": 64, "aux_loss_coef": 0.01}
)
SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)  # see test_train_mesh.py


def train(cfg, mesh=None):
    """Two AdamW steps of a mixture of experts from seed 0 (on `mesh`, or on one device): the
    trained model and each step's (loss, aux_loss)."""
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


@pytest.fixture(scope="module")
def reference():
    return train(CFG)  # dense and grouped experts compute the same values (tests/test_moe.py)


# dense: expert-parallel (8 x 32 tokens, 2 x 128 < 3 x 4 x 32); ragged: experts gathered
@pytest.mark.parametrize(
    "impl, overrides",
    [("dense", {}), ("ragged", {}), ("dense", {"scan_layers": True, "remat": "full"})],
    ids=["dense", "ragged", "dense-scanned-remat"],
)
def test_expert_sharded_training_equals_single_device(reference, impl, overrides):
    ref_model, ref_losses = reference
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=4"))
    model, losses = train(CFG.replace(**{"moe.impl": impl}, **overrides), mesh)
    spec = model.blocks.mlp.gate.weight.sharding.spec
    assert spec[1] == "fsdp"  # each device holds one expert
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_dense_experts_run_expert_parallel_without_gathering_expert_weights():
    scanned = CFG.replace(scan_layers=True)
    ep = mesh_bench("moe", scanned, "data=2,fsdp=4", batch=8, seq=32)
    zero3 = mesh_bench(
        "moe", scanned.replace(moe={"impl": "ragged"}), "data=2,fsdp=4", batch=8, seq=32
    )
    e, f, d = CFG.moe.n_experts, CFG.moe.d_ff, CFG.d_model
    whole = {(e, f, d), (e, d, f)}  # one layer's gate/up or down weight, all experts
    # The grouped product still gathers the expert weights (ZeRO-3 over experts): the check
    # sees them there, and nowhere in the expert-parallel step.
    assert whole & set(zero3.gathered_shapes)
    assert not whole & set(ep.gathered_shapes)
    # Tokens move in their place: the layer's tokens gathered over fsdp (d_model wide).
    assert (4 * 32, d) in set(ep.gathered_shapes)  # 4 sequences of 32 per data group
    # The grouped product runs on each device's own rows (`ExpertDispatch.own_rows`): it gathers
    # the expert weights and moves no tokens. At this tiny size the two steps move about the
    # same bytes per layer (0.61 MB expert-parallel, 0.58 MB grouped: data=2,fsdp=4, 8 x 32).
    assert (4 * 32, d) not in set(zero3.gathered_shapes)


def test_expert_parallel_where_tokens_are_fewer_bytes_than_expert_weights():
    gather = fsdp_gather(make_mesh(MeshConfig.parse("data=2,fsdp=4")))
    model = jax.eval_shape(lambda: eqllm.CausalLM(CFG, key=jax.random.key(0)))
    block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model.blocks)
    # 2 x tokens per data group against 3 x experts x expert d_ff = 384
    assert gather.expert_parallel(block, jax.ShapeDtypeStruct((8, 32, 64), "float32"))
    assert not gather.expert_parallel(block, jax.ShapeDtypeStruct((16, 32, 64), "float32"))
    ragged = jax.eval_shape(
        lambda: eqllm.CausalLM(CFG.replace(moe={"impl": "ragged"}), key=jax.random.key(0))
    )
    ragged = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), ragged.blocks)
    assert not gather.expert_parallel(ragged, jax.ShapeDtypeStruct((8, 32, 64), "float32"))
