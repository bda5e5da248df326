"""`eqllm plan`: a failure of JAX's lowering or of the TPU compiler that is not out of memory is
one line naming the stage and the cause (out of memory is a finding: tests/test_plan.py)."""

import jax
import pytest

from eqllm.cli import main
from eqllm.plan import step as plan_step
from eqllm.tpu_runtime import libtpu_installed

CAUSE = "INTERNAL: Mosaic failed to compile TPU kernel: unsupported shape"


class _Failing:
    def compile(self):
        raise jax.errors.JaxRuntimeError(f"{CAUSE}\n\nThe MLIR operation involved:\n  %0 = ...")


@pytest.mark.skipif(not libtpu_installed(), reason="needs libtpu (pip install 'eqllm[tpu]')")
@pytest.mark.parametrize("stage", ["JAX's lowering", "the TPU compiler"])
def test_a_failure_that_is_not_out_of_memory_is_one_line(capsys, monkeypatch, stage):
    lower = plan_step.lower_train_step

    def failing(recipe, mesh):
        if stage == "JAX's lowering":
            raise jax.errors.JaxRuntimeError(CAUSE)
        _, state, shapes = lower(recipe, mesh)
        return _Failing(), state, shapes

    monkeypatch.setattr(plan_step, "lower_train_step", failing)
    assert main(["plan", "zoo:llama-nano", "--topology", "v5e-1", "--seq", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after "compiling ..."
    assert err.startswith("eqllm: error: llama-nano on mesh")
    assert f"the step failed in {stage}: {CAUSE}; try another mesh" in err
