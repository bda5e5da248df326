"""A Mamba-2 stack on 8 simulated CPU devices (run by tests/test_sharding.py in its own process):
heads split over `tensor`, weights over `fsdp`, the same logits and gradients as one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.sharding import MeshConfig, MeshError, batch_sharding, make_mesh, shard_model

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
