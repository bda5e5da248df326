"""A tiny Qwen3-Next (Gated DeltaNet and gated attention layers, each with routed experts and a
gated shared expert) trained on 8 devices, split over data, fsdp (experts) and tensor (heads,
the Gated DeltaNet's too), equals training on one device: both stacks' layers follow the same
sharding rules and FSDP gathers each kind inside the group scan."""

import jax
import numpy as np
import pytest

import eqllm
from eqllm.sharding import MeshConfig, make_mesh
from tests.multidevice.test_moe_mesh import train

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

CONFIG = eqllm.zoo.config(
    "qwen3_next-nano",
    vocab_size=96,
    d_model=64,
    max_seq_len=32,
    n_layers=4,
    attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 16},
    linear={"full_every": 2, "key_head_dim": 16, "value_head_dim": 16},
    moe={"n_experts": 4, "d_ff": 32, "shared_d_ff": 32, "aux_loss_coef": 0.01},
)


# A hybrid's compile adds about a minute to the 8-device suite (tests/test_sharding.py runs it
# under a 15-minute limit): it runs in the slow set, as `EQLLM_MULTIDEVICE=1
# XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m slow tests/multidevice`.
@pytest.mark.slow
def test_hybrid_mesh_training_equals_single_device():
    ref_model, ref_losses = train(CONFIG)
    model, losses = train(CONFIG, make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2")))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
