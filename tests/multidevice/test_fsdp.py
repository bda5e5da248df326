"""FSDP during the step, and the layer loop's variants on a mesh (8 simulated devices).

The memory test reads XLA's buffer assignment of the compiled step (`eqllm bench --mesh`); the
equivalence tests run one real train step (SGD with rate 1, so the update is the gradient) of
the scanned stack, the unrolled stack, remat and gradient accumulation on a data x fsdp x tensor
mesh and compare loss and gradients with one device.
"""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqllm
from eqllm.bench.mesh import mesh_bench
from eqllm.eval.loss import mean_loss
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep
from tests.multidevice import CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SCANNED = CFG.replace(scan_layers=True)


@pytest.fixture(scope="module")
def memory():
    return {m: mesh_bench("tiny", SCANNED, m, batch=16, seq=32) for m in ("data=8", "fsdp=8")}


def test_fsdp_divides_weights_gradients_and_optimizer_state(memory):
    data, fsdp = memory["data=8"], memory["fsdp=8"]
    # Arguments are the parameters, AdamW's two moments and the batch: split 8 ways under fsdp
    # (the norm scales stay whole, hence not exactly 8).
    assert fsdp.argument_bytes < data.argument_bytes / 6
    # Temporaries (activations, gradients, one layer's gathered weights) do not grow: the
    # gathered weights of every layer are not kept at once, and gradients stay split.
    assert fsdp.temp_bytes <= data.temp_bytes
    assert fsdp.total_bytes < data.total_bytes


def test_fsdp_gathers_inside_the_layer_loop(memory):
    data, fsdp = memory["data=8"], memory["fsdp=8"]
    assert data.per_step["all-gather"] == 0
    # Seven weight matrices per layer gathered in the forward body and again in the backward.
    assert fsdp.per_layer["all-gather"] >= 2 * 7
    layers = SCANNED.n_layers
    assert fsdp.per_step["all-gather"] >= layers * fsdp.per_layer["all-gather"]
    # The layer gradients are reduced inside the backward loop, one layer at a time (XLA's CPU
    # backend lowers it as all-reduce + slice; a reduce-scatter is the same placement).
    assert fsdp.per_layer["all-reduce"] + fsdp.per_layer["reduce-scatter"] >= 1


BATCH = jax.random.randint(jax.random.key(7), (8, 33), 0, CFG.vocab_size)
VARIANTS = {
    "scanned": ({"scan_layers": True}, 1),
    "unrolled": ({"scan_layers": False}, 1),
    "remat": ({"scan_layers": True, "remat": "full"}, 1),
    "grad_accum": ({"scan_layers": True}, 2),
}


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients on one device (micro-batches of equal size average to the same)."""
    model = eqllm.CausalLM(SCANNED, key=jax.random.key(0))
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model, BATCH)
    return model, float(loss), grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layer_loop_variants_on_a_mesh_equal_one_device(reference, variant):
    overrides, accum = VARIANTS[variant]
    ref_model, ref_loss, ref_grads = reference
    model = eqllm.CausalLM(SCANNED.replace(**overrides), key=jax.random.key(0))
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    shardings = param_shardings(model, mesh)
    sharded = shard_model(model, mesh)
    step = TrainStep(optax.sgd(1.0), lambda _: 1.0, grad_accum=accum, param_shardings=shardings)
    new, _, metrics = step(
        sharded,
        optax.sgd(1.0).init(eqx.filter(sharded, eqx.is_inexact_array)),
        jax.device_put(BATCH, batch_sharding(mesh)),
    )
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-6)
    before, after = jax.tree.leaves(ref_model), jax.tree.leaves(new)
    for a, b, r in zip(before, after, jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), r, atol=2e-6, rtol=1e-4)
