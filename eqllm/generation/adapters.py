"""Many LoRA adapters over one copy of the base weights, chosen per row of a batch.

`stack_adapters(base, [adapted, ...])` replaces every linear layer that some adapter adapts by a
`MultiLoraLinear`: the base layer and the adapters stacked, A [n + 1, d_in, r] and
B [n + 1, r, d_out], index 0 holding zeros (no adapter). Ranks are padded with zeros to the
largest at that layer and each adapter's scale (alpha / r) is folded into its B; an adapter
that does not adapt a layer has zeros there. So adapters with different targets, ranks and
alphas share one tree, and `x A_i B_i` is exactly adapter i's update.

The engine's compiled steps take one more fixed-shape argument, each row's adapter index
(`Params.adapter`; 0: the base). Each layer's cached call is vmapped over rows with the row's
index set in its `MultiLoraLinear`s (`row_calls`), which gather the row's A and B: requests for
different adapters share one batch, nothing is merged into the base and nothing recompiles per
request. A model without adapters takes no index and runs as before. Speculative rounds verify
with each row's adapter too (`eqllm.generation.speculate`). On a mesh, A and B are split as
their base weight is (`shardings`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from eqllm.errors import EqllmError
from eqllm.lora import LoraLinear, adapters, get_path
from eqllm.nn import Linear


class AdapterError(EqllmError):
    """Adapters that cannot be served together, or a request for an adapter the engine lacks."""


class MultiLoraLinear(eqx.Module):
    """`base(x) + x A[index] B[index]`: a Linear with a stack of low-rank updates.

    `a` is [*layers, n + 1, d_in, r] and `b` [*layers, n + 1, r, d_out] (scale folded in);
    entry 0 is zeros. `index` is set only inside a step (`with_index`): None runs the base.
    """

    base: Linear
    a: Float[Array, "*layers n d_in r"]
    b: Float[Array, "*layers n r d_out"]
    index: Int[Array, ""] | None = None

    @jax.named_scope("eqllm.MultiLoraLinear")
    def __call__(self, x: Float[Array, "*rows d_in"], **kwargs) -> Float[Array, "*rows d_out"]:
        y = self.base(x, **kwargs)
        if self.index is None:
            return y
        a, b = self.a[self.index].astype(x.dtype), self.b[self.index].astype(x.dtype)
        delta = (x.reshape(-1, x.shape[-1]) @ a) @ b
        return y + delta.reshape(*x.shape[:-1], -1).astype(y.dtype)


def is_multi(node) -> bool:
    return isinstance(node, MultiLoraLinear)


def has_adapters(tree) -> bool:
    """Whether `tree` holds stacked adapters."""
    return any(is_multi(n) for n in jax.tree.leaves(tree, is_leaf=is_multi))


def count(tree) -> int:
    """How many adapters `tree` holds (0 without any)."""
    found = [n for n in jax.tree.leaves(tree, is_leaf=is_multi) if is_multi(n)]
    return found[0].a.shape[-3] - 1 if found else 0


def with_index(tree, index: Int[Array, ""] | None):
    """`tree` with every `MultiLoraLinear`'s index set to `index`."""
    return jax.tree.map(
        lambda n: (
            eqx.tree_at(lambda m: m.index, n, index, is_leaf=lambda v: v is None)
            if is_multi(n)
            else n
        ),
        tree,
        is_leaf=is_multi,
    )


def row_calls(model, layers: Sequence, index: Int[Array, " rows"] | None) -> list[Callable]:
    """Each layer's cached call (`CausalLM.cached_calls`) vmapped over rows; with `index`, each
    row runs with its own adapter."""
    calls = model.cached_calls(layers)
    if index is None or not has_adapters(layers):
        return [jax.vmap(call) for call in calls]

    def run(k, i, x, positions, cache, **extra):  # extra: `eqllm.stack.run.layer_extra`
        picked = list(layers)
        picked[k] = with_index(layers[k], i)
        return model.cached_calls(picked)[k](x, positions, cache, **extra)

    return [
        functools.partial(jax.vmap(functools.partial(run, k)), index) for k in range(len(layers))
    ]


def _base_of(node):
    return node.base if isinstance(node, LoraLinear | MultiLoraLinear) else node


def stack_adapters(base, adapted: Sequence, names: Sequence[str] | None = None):
    """`base` with the adapters of each model in `adapted` (LoRA models over the same base,
    `eqllm.lora.apply` or `eqllm.hub.load_adapter`) stacked into `MultiLoraLinear`s, adapter
    i + 1 being `adapted[i]`'s. `names` (one per adapter) name them in errors.

    AdapterError when an adapted model's architecture or shapes differ from the base's, or a
    layer it adapts holds other base weights than the base's own (an adapter trained on another
    model)."""
    names = list(names or [f"adapter {i + 1}" for i in range(len(adapted))])
    found = []
    for name, model in zip(names, adapted, strict=True):
        _check_same_base(base, model, name)
        layers = adapters(model)
        if not layers:
            raise AdapterError(f"adapter {name!r} has no LoRA layers; give a LoRA adapter")
        for path, layer in layers.items():
            own = _base_of(get_path(base, path))
            if not isinstance(own, Linear) or not _same(own.weight, layer.base.weight):
                raise AdapterError(
                    f"adapter {name!r}: its base weight at {path} differs from the served "
                    "model's; serve it over the base model it was trained from"
                )
        found.append(layers)
    paths = list(dict.fromkeys(p for layers in found for p in layers))
    stacked = [_stack(_base_of(get_path(base, p)), [f.get(p) for f in found]) for p in paths]
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], base, stacked)


def _stack(base: Linear, parts: list[LoraLinear | None]) -> MultiLoraLinear:
    *lead, d_out, d_in = base.weight.shape
    rank = max(p.rank for p in parts if p is not None)
    dtype = base.weight.dtype if jnp.issubdtype(base.weight.dtype, jnp.floating) else jnp.float32
    a = np.zeros((*lead, len(parts) + 1, d_in, rank), np.float32)
    b = np.zeros((*lead, len(parts) + 1, rank, d_out), np.float32)
    for i, part in enumerate(parts, start=1):
        if part is None:
            continue
        r = part.rank
        a[..., i, :, :r] = np.swapaxes(np.asarray(part.lora_a.weight, np.float32), -1, -2)
        b_t = np.swapaxes(np.asarray(part.lora_b.weight, np.float32), -1, -2)
        b[..., i, :r, :] = part.scale * b_t
    return MultiLoraLinear(base, jnp.asarray(a, dtype), jnp.asarray(b, dtype))


def _same(ours, theirs) -> bool:
    """Equal weights (theirs cast to our dtype: a base served in bfloat16)."""
    return ours.shape == theirs.shape and bool(jnp.array_equal(ours, theirs.astype(ours.dtype)))


def _check_same_base(base, model, name: str) -> None:
    """The adapted model's config and array shapes (adapters aside) are the base's."""
    family = getattr(getattr(base, "config", None), "family", None)
    if family != getattr(getattr(model, "config", None), "family", None):
        raise AdapterError(
            f"adapter {name!r} was made for another architecture ({_describe(model)}), not "
            f"the served {_describe(base)}; serve it over its own base model"
        )
    ours, theirs = (
        [x.shape for x in jax.tree.leaves(eqx.filter(_bases(m), eqx.is_array))]
        for m in (base, model)
    )
    if ours != theirs:
        raise AdapterError(
            f"adapter {name!r}: its base model's weight shapes differ from the served model's; "
            "serve it over the base model it was trained from"
        )


def _bases(model):
    return jax.tree.map(_base_of, model, is_leaf=lambda n: isinstance(n, LoraLinear))


def _describe(model) -> str:
    config = getattr(model, "config", None)
    if config is None:
        return type(model).__name__
    return f"{config.family} d_model={config.d_model} layers={config.n_layers}"


def check_adapter(index: int, available: int) -> None:
    """A request's adapter index must name one of the engine's adapters (0: none)."""
    if not isinstance(index, int) or not 0 <= index <= available:
        raise AdapterError(
            f"adapter={index!r}: this engine holds {available} adapter(s); give an index in "
            f"[0, {available}] (0: the base model)"
        )


def shardings(model, placed):
    """`placed` (a NamedSharding per array of `model`, as `eqllm.sharding.param_shardings`
    gives, which replicates what it does not know) with every `MultiLoraLinear`'s A split as
    its base weight's input and B as its output: a device holds its share of each adapter next
    to its share of the base, and the adapters' memory falls with the mesh as the base's does.
    The adapter and rank axes stay whole (a row's gather needs every adapter; the rank is
    small). On a row-parallel layer (o, down) x A then sums over the split input: one all-reduce
    of rows x r, where the base's own product needs rows x d_out."""

    def place(node, where):
        if not is_multi(node):
            return where
        spec = tuple(where.base.weight.spec)
        *lead, out, into = spec + (None,) * (node.base.weight.ndim - len(spec))
        mesh = where.base.weight.mesh
        a = NamedSharding(mesh, PartitionSpec(*lead, None, into, None))
        b = NamedSharding(mesh, PartitionSpec(*lead, None, None, out))
        return eqx.tree_at(lambda m: (m.a, m.b), where, (a, b))

    return jax.tree.map(place, model, placed, is_leaf=is_multi)
