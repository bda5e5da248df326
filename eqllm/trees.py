"""Small operations on pytrees of arrays that the model, training and planning share."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp


def cast_floating(tree, dtype):
    """Cast every floating-point array in `tree` to `dtype` (a no-op when already there)."""

    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def param_count(model_or_shapes) -> int:
    """Number of scalars in the arrays (or ShapeDtypeStructs) of a pytree."""
    leaves = jax.tree.leaves(model_or_shapes)
    return sum(math.prod(x.shape) for x in leaves if hasattr(x, "shape") and hasattr(x, "dtype"))
