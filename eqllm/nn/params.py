"""What the model knows about each of its arrays (`param_info`): logical axes, initialisation,
weight decay and muP role, read off the layers of `eqllm.nn.linear` by walking the model, so no
table keyed by parameter path has to agree with the model code."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

from eqllm.nn.linear import (
    Embedding,
    ExpertLinear,
    Int8Embedding,
    Int8Linear,
    Linear,
    Role,
    role_of,
)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """What the model knows about one array: its logical axes, initialisation and decay.

    `axes` has one entry per dimension, None for a dimension no rule splits (the leading
    `layers` axis of stacked blocks, norm scales). `init` is the role of a linear or embedding
    weight ("normal"/"residual"), "zeros" for a bias, None for arrays that keep the value their
    layer gave them (norm scales). `decay` marks the weights that AdamW decays: matrices of
    linear layers, not embeddings, biases or norms. `role` is how it scales with width
    (`Role`; an embedding table is "embedding" even when tied into the head).
    """

    axes: tuple[str | None, ...]
    init: str | None
    decay: bool
    role: Role = "vector"


def _is_layer(node) -> bool:
    return isinstance(node, Linear | Embedding | ExpertLinear)


def param_info(tree):
    """A pytree like `tree` holding a `ParamInfo` at every array (arrays or ShapeDtypeStructs).

    Found by walking the tree: the weights of `Linear` and `Embedding` layers carry their axes
    (stacked layers get None for the extra leading axes); every other array is replicated and
    keeps its value. A module that wraps a Linear (an adapter, say) is walked into, so its inner
    layer keeps its metadata.
    """

    def leading(x, axes) -> tuple[str | None, ...]:
        return (None,) * (len(x.shape) - len(axes)) + tuple(axes)

    def info(node):
        if isinstance(node, Linear):
            weight = ParamInfo(leading(node.weight, node.axes), node.init, True, role_of(node.axes))
            bias = None
            if node.bias is not None:
                bias = ParamInfo(leading(node.bias, node.axes[:1]), "zeros", False)
            node = eqx.tree_at(
                lambda m: (m.weight, m.bias), node, (weight, bias), is_leaf=lambda x: x is None
            )
            if isinstance(node, Int8Linear):  # the scales are split like the output channels
                scale = ParamInfo(leading(node.scale, node.axes[:1]), None, False)
                node = eqx.tree_at(lambda m: m.scale, node, scale)
            return node
        if isinstance(node, ExpertLinear):
            weight = ParamInfo(leading(node.weight, node.axes), node.init, True, role_of(node.axes))
            bias = None
            if node.bias is not None:
                bias = ParamInfo(leading(node.bias, node.axes[:2]), "zeros", False)
            return eqx.tree_at(
                lambda m: (m.weight, m.bias), node, (weight, bias), is_leaf=lambda x: x is None
            )
        if isinstance(node, Embedding):
            weight = ParamInfo(leading(node.weight, node.axes), "normal", False, "embedding")
            node = eqx.tree_at(lambda m: m.weight, node, weight)
            if isinstance(node, Int8Embedding):  # the scales are split like the rows
                scale = ParamInfo(leading(node.scale, node.axes[:1]), None, False)
                node = eqx.tree_at(lambda m: m.scale, node, scale)
            return node
        if hasattr(node, "shape") and hasattr(node, "dtype"):
            return ParamInfo((None,) * len(node.shape), None, False)
        return None

    return jax.tree.map(info, tree, is_leaf=_is_layer)


def is_param_info(x) -> bool:
    return isinstance(x, ParamInfo)
