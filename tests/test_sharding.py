"""Sharding: the 8-device tests run in a subprocess (XLA's device count is fixed at import)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from eqllm.sharding import MeshConfig, MeshError, estimate_memory, per_device_bytes

ROOT = Path(__file__).resolve().parent.parent


# The 8-device suite in two halves, one subprocess each: with `-n 2` they run side by side, and
# each half keeps its own time limit as the suite grows.
_HALVES = {
    "experts": (
        "test_dispatch_mesh.py",
        "test_moe_mesh.py",
        "test_deepseek_mesh.py",
        "test_hybrid_mesh.py",
        "test_pipeline_moe_mesh.py",
    ),
    "rest": (
        "test_train_mesh.py",
        "test_pipeline_mesh.py",
        "test_serve_mesh.py",
        "test_lora_mesh.py",
        "test_fused_attention_mesh.py",
        "test_fsdp.py",
        "test_mesh.py",
        "test_own_model_mesh.py",
        "test_mamba2_mesh.py",
        "test_adapters_mesh.py",  # slow, so left out here: tests/test_serve_mesh.py runs it
    ),
}


def test_the_halves_cover_the_multidevice_suite():
    files = {p.name for p in (ROOT / "tests" / "multidevice").glob("test_*.py")}
    halves = [name for half in _HALVES.values() for name in half]
    assert sorted(halves) == sorted(files), "add the new file to one of _HALVES"


@pytest.mark.slow
@pytest.mark.parametrize("half", sorted(_HALVES))
def test_multidevice_suite_on_8_simulated_devices(half):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "EQLLM_MULTIDEVICE": "1",
        "JAX_PLATFORMS": "cpu",
    }
    files = [str(ROOT / "tests" / "multidevice" / name) for name in _HALVES[half]]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]


def test_mesh_resolution():
    assert MeshConfig().resolve(8) == (1, 8, 1, 1)  # (pipeline, data, fsdp, tensor)
    assert MeshConfig(data=-1, fsdp=2, tensor=2).resolve(8) == (1, 2, 2, 2)
    assert MeshConfig.parse("pipeline=2,data=2,fsdp=2").resolve(8) == (2, 2, 2, 1)
    assert MeshConfig(pipeline=4).resolve(8) == (4, 2, 1, 1)
    with pytest.raises(MeshError, match="positive integer or -1"):
        MeshConfig(data=0)
    with pytest.raises(MeshError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)


def test_per_device_memory_of_llama3_8b_on_a_notional_8_gpu_node():
    """From shapes alone: fsdp=8 holds 1/8 of the matrices per device, data=8 all of them."""
    import equinox as eqx

    import eqllm

    cfg = eqllm.zoo.config("llama3-8b")
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, cfg, key=jax.random.key(0))
    full = 4 * eqllm.zoo.param_count("llama3-8b")
    assert per_device_bytes(shapes, {"data": 8, "fsdp": 1, "tensor": 1}) == full
    norms = 4 * 4096 * (2 * 32 + 1)  # the norm scales stay replicated
    assert (
        per_device_bytes(shapes, {"data": 1, "fsdp": 8, "tensor": 1}) == (full - norms) // 8 + norms
    )
    est = estimate_memory(cfg, {"data": 1, "fsdp": 8, "tensor": 1}, batch_size=8, seq_len=2048)
    assert est.optimizer == 2 * est.params and est.activations > 0
