"""A model of one's own (docs/examples/own_model.py) on a mesh: placed by its layers' logical
axes, its loss and one step of eqllm's optimizer on it (the gradient reduced over the devices)
equal one device's; its LoRA adapters are placed like their base and merge in place."""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqllm import lora
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh
from eqllm.train import init_opt_state, make_optimizer
from tests.test_modules import load_example

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

own = load_example()


def one_update(optimizer):
    @eqx.filter_jit
    def update(model, opt_state, tokens):
        objective = own.NextToken()
        loss, grads = eqx.filter_value_and_grad(lambda m: objective.loss(m, {"tokens": tokens})[0])(
            model
        )
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return update


def test_own_model_on_a_mesh_equals_one_device():
    model, scales = own.build(jax.random.key(0))
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    placed, shardings = own.place(model, mesh)
    assert placed.layers[0].attn.q_proj.weight.sharding.spec == P("tensor", "fsdp")
    assert placed.layers[1].mlp.down.weight.sharding.spec == P("fsdp", "tensor")
    assert placed.embed.weight.sharding.spec == P("tensor", "fsdp")
    assert placed.layers[0].attn_norm.weight.sharding.spec == P()
    assert shardings.head.weight.spec == P("tensor", "fsdp")

    # The loss (the forward pass) and the updated weights (the gradient, reduced over the
    # devices, and eqllm's AdamW with muP's factors) equal one device's.
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256)
    on_mesh = jax.device_put(tokens, batch_sharding(mesh))
    optimizer = make_optimizer(own.SPEC, 10, model, scales=scales)
    update = one_update(optimizer)
    ref, _, ref_loss = update(model, init_opt_state(optimizer, model), tokens)
    new, opt_state, loss = update(placed, init_opt_state(optimizer, placed, shardings), on_mesh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for get in (lambda m: m.layers[0].attn.q_proj.weight, lambda m: m.head.weight):
        np.testing.assert_allclose(np.asarray(get(new)), np.asarray(get(ref)), atol=1e-6)
    assert new.layers[0].attn.q_proj.weight.sharding.spec == P("tensor", "fsdp")


def test_own_models_adapters_follow_their_base_on_a_mesh():
    model, _ = own.build(jax.random.key(0))
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    adapted = lora.apply(model, rank=4, alpha=8, targets=["q_proj", "up"], key=jax.random.key(1))
    adapted = jax.tree.map(lambda x: x + 0.01 if eqx.is_inexact_array(x) else x, adapted)
    placed, _ = own.place(adapted, mesh)
    q = placed.layers[0].attn.q_proj
    assert q.lora_a.weight.sharding.spec == P(None, "fsdp")  # A: (rank, d_model)
    assert q.lora_b.weight.sharding.spec == P("tensor")  # B: (heads, rank)
    merged = eqx.filter_jit(lora.merge)(placed)
    assert merged.layers[0].attn.q_proj.weight.sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(
        np.asarray(merged.layers[1].mlp.up.weight),
        np.asarray(lora.merge(adapted).layers[1].mlp.up.weight),
        atol=1e-6,
    )
