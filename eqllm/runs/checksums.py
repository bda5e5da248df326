"""Checksums of a checkpoint's arrays: written with them, checked when they are read back, so a
garbled byte is caught even where the file format still decodes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _as_uint32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    bits = x.dtype.itemsize * 8
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    if bits == 16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32).ravel()
    if bits == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32).ravel()
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    raise TypeError(f"no checksum for dtype {x.dtype}")  # a bug: every saved dtype is listed


@jax.jit
def _checksums(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    def one(x):
        v = _as_uint32(jnp.asarray(x))
        # Position-weighted sum mod 2**32: order-independent to reduce, sensitive to any bit
        # flip and to swapped elements.
        weights = jnp.arange(v.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
        return jnp.sum(v * weights, dtype=jnp.uint32) ^ jnp.uint32(v.shape[0])

    return {k: one(x) for k, x in tree.items()}


def fingerprints(tree: dict[str, Any]) -> dict[str, int]:
    """A 32-bit checksum of the bits of each array in a flat dict (computed where they live)."""
    return {k: int(v) for k, v in jax.device_get(_checksums(tree)).items()}


def verify_fingerprints(tree: dict[str, Any], expected: dict[str, int]) -> list[str]:
    """Names of the arrays of `tree` whose checksum differs from `expected` (where listed)."""
    got = fingerprints({k: v for k, v in tree.items() if k in expected})
    return [k for k, v in got.items() if expected[k] != v]
