"""Sampling settings per row, kept on the host: one array per `Sampling` field, stacked into the
`Sampling` a compiled step takes (one value per row: a slot, or a row of a prefill call)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from eqllm.generation.sampling import Sampling, sampling


@functools.cache
def _off() -> Sampling:
    """Greedy, every filter off, as numpy scalars (built once)."""
    return jax.device_get(sampling(0.0))


class RowSettings:
    """Each of `rows` rows' sampling settings; greedy with every filter off until `set`, so that
    an idle slot or a padding row switches no filter on for the others."""

    def __init__(self, rows: int):
        self.names = [f.name for f in dataclasses.fields(_off())]
        self.values = {name: np.full(rows, getattr(_off(), name)) for name in self.names}

    def set(self, row: int, settings: Sampling) -> None:
        for name in self.names:
            self.values[name][row] = getattr(settings, name)

    def reset(self, row: int) -> None:
        self.set(row, _off())

    def stacked(self, rows: int | None = None) -> Sampling:
        """The first `rows` rows (None: all) as one `Sampling` of arrays (built from the leaves:
        its constructor checks for scalars)."""
        leaves = [jnp.asarray(self.values[name][:rows]) for name in self.names]
        return jax.tree.unflatten(jax.tree.structure(_off()), leaves)
