"""Serving on a mesh: the 8-device tests (tests/multidevice/test_serve_mesh.py and
test_adapters_mesh.py) run in their own process, since XLA's device count is fixed when JAX
starts; in the slow run (about two minutes: three engines compiled; the adapters' file less)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eqllm.sharding import MeshError

ROOT = Path(__file__).resolve().parent.parent


def _on_8_devices(name: str, passed: int) -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "EQLLM_MULTIDEVICE": "1",
        "JAX_PLATFORMS": "cpu",
    }
    test = ROOT / "tests" / "multidevice" / name
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "slow", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, str(test)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert f"{passed} passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_tensor_parallel_serving_on_8_simulated_devices():
    _on_8_devices("test_serve_mesh.py", 4)


@pytest.mark.slow
def test_lora_adapters_serve_on_8_simulated_devices():
    _on_8_devices("test_adapters_mesh.py", 1)


def test_a_mesh_larger_than_the_devices_fails_clearly():
    from eqllm.generation.placement import serving_mesh

    with pytest.raises(MeshError, match="needs 64 devices but 1 are available"):
        serving_mesh("tensor=64", devices=[object()])


@pytest.mark.slow  # the command line imports every command (~20 s here on its own)
def test_serve_refuses_a_mesh_it_cannot_build_before_loading(capsys):
    from eqllm import cli

    assert cli.main(["serve", "llama-nano", "--mesh", "tensor=64"]) == 2
    assert "--mesh pipeline=1,data=1,fsdp=1,tensor=64 needs 64 devices" in capsys.readouterr().err
    assert cli.main(["serve", "llama-nano", "--mesh", "pipeline=2"]) == 2
    assert "serving splits over tensor and data only" in capsys.readouterr().err
