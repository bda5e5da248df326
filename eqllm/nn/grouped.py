"""Grouped matrix products (mixture-of-experts rows sorted by expert) with TPU's megablox
kernels, forward and backward.

`jax.lax.ragged_dot` lowers on TPU to grouped kernels for its forward pass and its gradient
with respect to the rows, but its gradient with respect to the expert weights to a dense
convolution over every expert and every row (docs/moe.md). The megablox kernels of
`jax.experimental.pallas.ops.tpu.megablox` compute that gradient as a grouped product too
(`tgmm`). Their own VJP traces the backward kernels under whatever matmul precision is global
when the gradient is taken, and Mosaic refuses 16-bit operands at "highest"; this one traces
every kernel at the default precision for 16-bit operands (exact for them at any precision).

Tiles: a kernel reads its row block once per output-column tile and an expert's weight tile
once per row tile (megablox's own cost estimate counts the same), so small tiles multiply the
HBM traffic. The default (128, 128, 128) made the kernels 75% of mixtral-8x7b's step bytes on
v6e-256; `tiling` takes up to 512 rows by 1024 x 1024 (MaxText's megablox default), which
fits the chips' default scoped VMEM.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm
from jaxtyping import Array, Float, Int


def tiling(rows: int, d_in: int, d_out: int) -> tuple[int, int, int]:
    """Megablox's (rows, contracted, output) tile sizes: rows tiles divide the rows (up to
    512); the others take the whole dimension up to 1024, else the largest of 1024, 512, 256
    and 128 that divides it (megablox takes an uneven last tile otherwise)."""

    def tile(d: int) -> int:
        return d if d <= 1024 else next((t for t in (1024, 512, 256, 128) if d % t == 0), 128)

    return math.gcd(rows, 512), tile(d_in), tile(d_out)


def _precision(dtype):
    return jax.default_matmul_precision("default" if jnp.dtype(dtype).itemsize < 4 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(x, w, sizes, interpret: bool):
    """x (rows, d_in) times w[e].T (w: (n, d_out, d_in)) for each group's rows."""
    tiles = tiling(x.shape[0], w.shape[2], w.shape[1])
    with _precision(x.dtype):
        return gmm(x, w, sizes, x.dtype, tiles, transpose_rhs=True, interpret=interpret)


def _gmm_fwd(x, w, sizes, interpret):
    return _gmm(x, w, sizes, interpret), (x, w, sizes)


def _gmm_bwd(interpret, residual, dy):
    x, w, sizes = residual
    rows, d_in, d_out = x.shape[0], w.shape[2], w.shape[1]
    with _precision(x.dtype):
        dx = gmm(dy, w, sizes, x.dtype, tiling(rows, d_out, d_in), interpret=interpret)
        dw = tgmm(x.T, dy, sizes, w.dtype, tiling(rows, d_in, d_out), interpret=interpret)
    return dx, jnp.swapaxes(dw, 1, 2), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def megablox_matmul(
    x: Float[Array, "rows d_in"],
    weight: Float[Array, "n d_out d_in"],
    group_sizes: Int[Array, " n"],
    *,
    interpret: bool = False,
) -> Float[Array, "rows d_out"]:
    """Rows sorted by expert, `group_sizes[e]` of them for expert e, times that expert's
    `weight[e]` (stored (d_out, d_in)); rows past the groups (padding) give zeros and get zero
    gradients (the kernels leave them unwritten). `interpret`: Pallas' interpreter (any
    backend: tests)."""
    sizes = group_sizes.astype(jnp.int32)
    valid = (jnp.arange(x.shape[0]) < sizes.sum())[:, None]
    y = _gmm(jnp.where(valid, x, 0), weight.astype(x.dtype), sizes, interpret)
    return jnp.where(valid, y, 0)
