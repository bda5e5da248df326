"""`eqllm.bench.hlo.Program.total`: the program's bytes counted by XLA's own rules, so that
scaling XLA's cost analysis by the loops' trip counts (`loop_factor`) scales what XLA counted."""

import jax
import jax.numpy as jnp
import pytest

from eqllm.bench.hlo import Program


def _scanned_stack(ws, x):
    """A scanned stack of layers: its gradient reads each layer's weights with a dynamic slice
    and writes each layer's gradient into the stacked gradient in place."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, ws)[0].sum()


def _slices(a, i):
    """Unfused slices and an in-place update of a large buffer."""
    part = jax.lax.dynamic_slice_in_dim(a, i, 4)
    return jax.lax.dynamic_update_slice_in_dim(a, part * 2, i + 8, axis=0), a[:16].sum()


@pytest.mark.parametrize(
    "fn, args",
    [
        (jax.grad(_scanned_stack), (jnp.ones((16, 256, 256)), jnp.ones((8, 256)))),
        (_slices, (jnp.ones((4096, 256)), 3)),
    ],
    ids=["scanned-stack-gradient", "slices"],
)
def test_bytes_per_loop_pass_are_xla_cost_analysis_bytes(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    program = Program(compiled.as_text())
    xla = compiled.cost_analysis()["bytes accessed"]
    assert program.total("bytes", per_pass=True) == pytest.approx(xla, rel=1e-3)


def test_the_loop_factor_scales_by_what_each_layer_moves_not_the_whole_stack():
    ws, x = jnp.ones((16, 256, 256)), jnp.ones((8, 256))
    program = Program(jax.jit(jax.grad(_scanned_stack)).lower(ws, x).compile().as_text())
    # the 16 trips move one layer's weights and gradient each; the rest (the stacked weights'
    # gradient, zeroed and returned once) is outside the loop, so the factor stays well below 16
    assert 2 < program.loop_factor("bytes") < 8
