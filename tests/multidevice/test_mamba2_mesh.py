"""A Mamba-2 stack on 8 simulated CPU devices (run by tests/test_sharding.py in its own process):
heads split over `tensor`, weights over `fsdp`, the same logits and gradients as one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqllm
from eqllm.eval.loss import mean_loss
from eqllm.sharding import (
    MeshConfig,
    MeshError,
    batch_sharding,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.train import TrainStep

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

# 8 heads of 16 in 2 groups of B and C: every mesh below splits whole heads.
CFG = eqllm.zoo.config(
    "mamba2-nano",
    vocab_size=96,
    d_model=64,
    n_layers=2,
    max_seq_len=32,
    linear={"n_key_heads": 2, "n_value_heads": 8, "value_head_dim": 16, "key_head_dim": 8},
)


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CFG, key=jax.random.key(0))


@pytest.mark.parametrize("mesh_text", ["data=2,fsdp=2,tensor=2", "data=1,tensor=8"])
def test_sharded_forward_and_gradients_equal_single_device(model, mesh_text):
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    sharded = shard_model(model, mesh)
    x = sharded.blocks.attn.x_proj.weight  # (layers, heads * head_dim, d_model)
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    assert x.addressable_shards[0].data.shape == (2, 128 // tensor, 64 // fsdp)
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 96)

    def loss(m, t):
        return jnp.mean(m(t) ** 2)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = grad(sharded, jax.device_put(tokens, batch_sharding(mesh)))
    want_value, want_grads = grad(model, tokens)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_tensor_must_split_whole_heads(model):
    mesh = make_mesh(MeshConfig.parse("data=1,tensor=8"))
    narrow = CFG.replace(linear={"n_value_heads": 4, "value_head_dim": 32})
    with pytest.raises(MeshError, match="tensor=8 does not divide linear.n_value_heads=4"):
        shard_model(eqllm.CausalLM(narrow, key=jax.random.key(0)), mesh)


def test_a_train_step_with_fsdp_gathers_equals_one_device():
    """One SGD step (rate 1: the update is the gradient) on data x fsdp x tensor, the layers'
    weights gathered one layer at a time inside the scan, against one device."""
    model = eqllm.CausalLM(CFG, key=jax.random.key(0))  # its own: the step donates the weights
    batch = jax.random.randint(jax.random.key(7), (8, 33), 0, CFG.vocab_size)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model, batch)
    before = [np.asarray(a) for a in jax.tree.leaves(model)]  # the step donates what it gets
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    sharded = shard_model(model, mesh)
    step = TrainStep(optax.sgd(1.0), lambda _: 1.0, param_shardings=param_shardings(model, mesh))
    new, _, metrics = step(
        sharded,
        optax.sgd(1.0).init(eqx.filter(sharded, eqx.is_inexact_array)),
        jax.device_put(batch, batch_sharding(mesh)),
    )
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    for a, b, g in zip(before, jax.tree.leaves(new), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a - np.asarray(b), g, atol=2e-6, rtol=1e-4)
