"""A tiny DeepSeek-V3 (latent attention, a dense first layer, sigmoid routing with a moving
correction bias over groups of experts), a tiny GLM-4.5 (the same routing and dense prefix on
grouped-query attention with partial rotary, q/k/v biases and QK-norm) and a tiny gpt-oss
(attention sinks, windowed and full layers, biased clamped experts) and a tiny Llama 4 (chunked
and global NoPE layers, experts that read the score-scaled token) trained on 8 devices, split
over data, fsdp (experts) and tensor (heads), equal training on one device."""

import jax
import numpy as np
import pytest

import eqllm
from eqllm.sharding import MeshConfig, make_mesh
from tests.multidevice.test_moe_mesh import train

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SMALL = dict(vocab_size=96, d_model=64, max_seq_len=32, n_layers=2)
CONFIGS = {
    "deepseek_v3": eqllm.zoo.config(
        "deepseek_v3-nano",
        **SMALL,
        moe={"bias_update_speed": 0.01, "aux_loss_coef": 0.01},
    ),
    "glm4_moe": eqllm.zoo.config(
        "glm4_moe-nano",
        **SMALL,
        attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 16},
        moe={"bias_update_speed": 0.01, "aux_loss_coef": 0.01},
    ),
    "gpt_oss": eqllm.zoo.config(
        "gpt_oss-nano",
        **SMALL,
        attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "sliding_window": 8},
        moe={"n_experts": 4, "d_ff": 32},
    ),
    # Chunks of 8 in the first layer, a global NoPE layer tuned from position 3, top-1 sigmoid
    # experts that read the score-scaled token, and the shared expert.
    "llama4": eqllm.zoo.config(
        "llama4-nano",
        **SMALL,
        attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "chunk_size": 8},
        **{"attention.global_every": 2, "positions.nope_every": 2},
        **{"attention.temperature_floor": 4},
        moe={"n_experts": 4, "d_ff": 32, "shared_d_ff": 32},
    ),
}


# GLM-4.5's case adds about a minute to the 8-device suite, which tests/test_sharding.py runs
# under a 15-minute limit: it runs in the slow set, as `EQLLM_MULTIDEVICE=1
# XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m slow tests/multidevice`.
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow) if f in ("glm4_moe", "llama4") else f
        for f in sorted(CONFIGS)
    ],
)
def test_mesh_training_equals_single_device(family):
    cfg = CONFIGS[family]
    ref_model, ref_losses = train(cfg)
    model, losses = train(cfg, make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2")))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    if family in ("deepseek_v3", "glm4_moe"):  # the correction bias moved, the same way on the mesh
        assert np.abs(np.asarray(model.blocks.mlp.score_bias)).max() > 0
