"""The fused attention path on a mesh: `jax.nn.dot_product_attention` with the arguments the
cuDNN path builds (XLA's implementation on CPU) gives the same loss and gradients sharded over
batch, fsdp and heads as the model's own attention on one device."""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, shard_model
from tests.multidevice import CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def loss(model, tokens):
    logits = model(tokens[:, :-1])
    targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))


def test_fused_attention_on_a_mesh_equals_the_models_own_on_one_device():
    config = CFG.replace(attention={"sliding_window": 12})  # windowed too
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    attn = copy.copy(model.blocks.attn)
    object.__setattr__(attn, "kernel", "xla")
    fused = eqx.tree_at(lambda m: m.blocks.attn, model, attn)
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 96)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    want, want_grads = grad(model, tokens)
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    got, got_grads = grad(shard_model(fused, mesh), jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
