"""Sharding on 8 simulated CPU devices (run by tests/test_sharding.py in its own process)."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.sharding import (
    MeshConfig,
    MeshError,
    batch_sharding,
    make_mesh,
    shard_model,
    spec_for,
)
from tests.multidevice import CFG, MESHES

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CFG, key=jax.random.key(0))


@pytest.mark.parametrize("mesh_text", MESHES)
def test_parameters_are_sharded_as_the_rules_say(model, mesh_text):
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    sharded = shard_model(model, mesh)
    q = sharded.blocks.attn.q_proj.weight
    assert q.sharding.spec == spec_for(("layers", "heads", "d_model"), q.shape, mesh)
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    # Each device holds 1/(tensor*fsdp) of a q projection and 1/tensor of an MLP's hidden units.
    assert q.addressable_shards[0].data.shape == (2, 64 // tensor, 64 // fsdp)
    down = sharded.blocks.mlp.down.weight
    assert down.addressable_shards[0].data.shape == (2, 64 // fsdp, 128 // tensor)


@pytest.mark.parametrize("mesh_text", MESHES)
def test_sharded_forward_equals_single_device(model, mesh_text):
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 96)
    reference = model(tokens)
    forward = eqx.filter_jit(lambda m, t: m(t))
    out = forward(shard_model(model, mesh), jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_allclose(out, reference, atol=2e-6)


def test_bad_meshes_fail_clearly(model):
    with pytest.raises(MeshError, match="needs 12 devices but 8 are available"):
        make_mesh(MeshConfig(data=3, fsdp=2, tensor=2))
    with pytest.raises(MeshError, match="does not divide the 8 devices"):
        make_mesh(MeshConfig(data=-1, fsdp=3))
    mesh = make_mesh(MeshConfig.parse("data=1,tensor=8"))
    with pytest.raises(MeshError, match="tensor=8 does not divide attention.n_kv_heads=2"):
        shard_model(
            eqllm.CausalLM(CFG.replace(attention={"n_kv_heads": 2}), key=jax.random.key(0)), mesh
        )
    with pytest.raises(MeshError, match="bad mesh item"):
        MeshConfig.parse("data=2,stages=4")
