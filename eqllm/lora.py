"""Low-rank adapters (LoRA; Hu et al., 2021): `apply` wraps linear layers, `merge` folds them in.

An adapted projection computes `base(x) + scale * B (A x)` with A [rank, in] and B [out, rank],
`scale = alpha / rank`, and B zero at the start, so a freshly adapted model computes exactly what
its base does (PEFT's convention). A and B are `eqllm.nn.Linear` layers carrying the logical
axis of the side they share with the base weight (A's input, B's output), so sharding and the
weight-decay mask are derived for them like for any other layer (`eqllm.nn.param_info`).

Targets are named as Hugging Face names the modules of eqllm's model (`q_proj`, `down_proj`,
GPT-2's `c_attn`): the names come from the family's key table (`eqllm.families`), where each
`....weight` row of a linear layer gives its module name. A fused Hugging Face module (GPT-2's
`c_attn`, the q, k and v projections in one) adapts each of its eqllm projections. In any other
tree of eqllm layers (a model of one's own), a target is the attribute name of its `Linear`
layers (`q_proj`, `up`, `head`): every linear layer so named is adapted.

Layers call their linear modules, so the wrapper takes effect in the stacked (scanned) blocks, in
cached decoding and on a mesh without any change to the model code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqllm import families
from eqllm.errors import EqllmError
from eqllm.model import CausalLM
from eqllm.nn import Linear


class LoraError(EqllmError):
    """Bad adapter settings or an adapter that does not fit its base model."""


class LoraLinear(eqx.Module):
    """`base(x) + scale * lora_b(lora_a(x))`: a Linear with a low-rank update.

    Arguments:
        base: the wrapped layer, frozen in LoRA training.
        rank: the update's rank.
        alpha: PEFT's `lora_alpha` (scale = alpha / rank).
        key: draws A as PEFT does (uniform in +-1/sqrt(in), Kaiming with a = sqrt(5)); B is zero.
        dropout: dropout probability on the adapter's input, in training steps only.

    A stacked base (leading `layers` axes, as in the scanned blocks) gets stacked adapters.
    """

    base: Linear
    lora_a: Linear  # weight [*layers, rank, in]
    lora_b: Linear  # weight [*layers, out, rank]
    # Dropout on the adapter's input; it acts only while `key` is set (in a training step, see
    # `with_dropout_keys`): layers call their modules without a key.
    key: PRNGKeyArray | None
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        base: Linear,
        *,
        rank: int,
        alpha: int | float,
        key: PRNGKeyArray,
        dropout: float = 0.0,
    ):
        *lead, d_out, d_in = base.weight.shape
        dtype = base.weight.dtype
        out_axis, in_axis = base.axes
        bound = 1.0 / math.sqrt(d_in)
        self.base = base
        self.lora_a = _linear(
            jax.random.uniform(key, (*lead, rank, d_in), jnp.float32, -bound, bound).astype(dtype),
            (None, in_axis),
        )
        self.lora_b = _linear(jnp.zeros((*lead, d_out, rank), dtype), (out_axis, None))
        self.scale = float(alpha) / rank
        self.dropout = float(dropout)
        self.key = None

    @property
    def rank(self) -> int:
        return self.lora_a.weight.shape[-2]

    @jax.named_scope("eqllm.LoraLinear")
    def __call__(self, x: Float[Array, "*rows d_in"], **kwargs) -> Float[Array, "*rows d_out"]:
        """`kwargs` go to the base product (the adapter runs in the input's dtype)."""
        y = self.base(x, **kwargs)
        if self.key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(self.key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(x.dtype)
        delta = self.lora_b(self.lora_a(x))
        return y + (self.scale * delta).astype(y.dtype)


def _linear(weight, axes) -> Linear:
    """A bias-free Linear holding `weight` (which may have leading `layers` axes)."""
    *_, d_out, d_in = weight.shape
    layer = Linear(d_in, d_out, axes=axes, key=jax.random.key(0), dtype=weight.dtype)
    return eqx.tree_at(lambda m: m.weight, layer, weight)


def is_lora(node) -> bool:
    return isinstance(node, LoraLinear)


def module_names(family: str, experts: bool | None = None) -> dict[str, list[tuple[str, ...]]]:
    """Hugging Face module name -> the eqllm paths of its linear layers, one tuple per module.

    Read from the family's key table: a row `...{i}.self_attn.q_proj.weight ->
    blocks.attn.q_proj.weight` names module `q_proj` at eqllm path `blocks.attn.q_proj`. A fused
    row (GPT-2's `c_attn`) gives a tuple of several paths; a name used twice (GPT-2's `c_proj` in
    attention and in the MLP) gives several tuples. `experts`: whether the model has experts
    (leaves out the rows of the other kind, `Row.experts`; None: every row).
    """
    names: dict[str, list[tuple[str, ...]]] = {}
    for row in families.get(family).table:
        if not row.module or (experts is not None and row.experts not in (None, experts)):
            continue
        if not row.hf.endswith(".weight") or not all(p.endswith(".weight") for p in row.eqllm):
            continue
        short = row.hf.removesuffix(".weight").rsplit(".", 1)[-1]
        names.setdefault(short, []).append(tuple(p.removesuffix(".weight") for p in row.eqllm))
    return names


def tree_module_names(tree) -> dict[str, list[tuple[str, ...]]]:
    """Attribute name -> the paths of the linear layers so named, for any tree of eqllm layers:
    `{"q_proj": [("blocks.0.attn.q_proj",), ("blocks.1.attn.q_proj",)], "head": [("head",)]}`
    (the form of `module_names`, without fused modules)."""
    names: dict[str, list[tuple[str, ...]]] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_linear)
    for path, node in flat:
        if _is_linear(node):
            where = jax.tree_util.keystr(path, simple=True, separator=".")
            names.setdefault(where.rsplit(".", 1)[-1], []).append((where,))
    return names


def _is_linear(node) -> bool:
    return isinstance(node, Linear | LoraLinear)


def _names(model) -> tuple[dict[str, list[tuple[str, ...]]], str]:
    """(target name -> module paths, what to call the model in messages): Hugging Face names
    for eqllm's model, attribute names for any other tree."""
    if isinstance(model, CausalLM):  # the modules this model has (a stack may be absent)
        cfg = model.config
        names = {
            name: [m for m in modules if all(get_path(model, p) is not None for p in m)]
            for name, modules in module_names(cfg.family, cfg.moe is not None).items()
        }
        return {k: v for k, v in names.items() if v}, f"{cfg.family} model"
    return tree_module_names(model), "model"


def get_path(model, path: str):
    """The submodule at a dotted eqllm path (`blocks.attn.q_proj`, `blocks.0.mlp.up` in a list),
    or None if absent."""
    node = model
    for part in path.split("."):
        if isinstance(node, list | tuple) and part.isdigit():
            node = node[int(part)] if int(part) < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
    return node


def available_targets(model) -> list[str]:
    """The target names of `model`'s linear layers: Hugging Face module names in key-table order
    for eqllm's model, attribute names in tree order for any other tree of eqllm layers."""
    names, _ = _names(model)
    return [
        name
        for name, modules in names.items()
        if all(_is_linear(get_path(model, p)) for m in modules for p in m)
    ]


def target_paths(model, targets: Sequence[str]) -> list[str]:
    """The paths of the linear layers the names `targets` pick (see `available_targets`)."""
    if isinstance(targets, str) or not targets:
        raise LoraError(
            f"lora targets={targets!r}: give a non-empty list of module names, e.g. "
            f"{available_targets(model)[:4]}"
        )
    available = available_targets(model)
    unknown = [t for t in targets if t not in available]
    names, what = _names(model)
    if unknown:
        raise LoraError(
            f"lora targets {unknown} are not linear modules of this {what}; available: "
            f"{', '.join(available)}"
        )
    return [p for t in dict.fromkeys(targets) for module in names[t] for p in module]


def apply(
    model,
    *,
    rank: int,
    alpha: int | float,
    targets: Sequence[str],
    dropout: float = 0.0,
    key: PRNGKeyArray,
):
    """`model` with the `targets` projections wrapped in `LoraLinear` adapters (B = 0).

    Arguments:
        rank: the adapters' rank (> 0).
        alpha: PEFT's `lora_alpha`; the update is scaled by alpha / rank.
        targets: Hugging Face module names (`["q_proj", "v_proj"]`), or in a tree of one's own
            the layers' attribute names; see `available_targets`.
        dropout: dropout probability on the adapter's input, in training steps only.
        key: PRNG key for A.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraError(f"lora rank={rank!r} must be a positive integer (8 or 16 are usual)")
    if not alpha > 0:
        raise LoraError(f"lora alpha={alpha!r} must be > 0 (the update is scaled by alpha/rank)")
    if not 0 <= dropout < 1:
        raise LoraError(f"lora dropout={dropout!r} must be in [0, 1)")
    paths = target_paths(model, targets)
    already = [p for p in paths if is_lora(get_path(model, p))]
    if already:
        raise LoraError(f"{already} already hold adapters; merge them first (eqllm.lora.merge)")
    keys = jax.random.split(key, len(paths))
    return eqx.tree_at(
        lambda m: [get_path(m, p) for p in paths],
        model,
        [
            LoraLinear(get_path(model, p), rank=rank, alpha=alpha, key=k, dropout=dropout)
            for p, k in zip(paths, keys, strict=True)
        ],
    )


def adapters(model) -> dict[str, LoraLinear]:
    """eqllm path -> adapter, for every `LoraLinear` in `model`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_lora)
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): node
        for path, node in flat
        if is_lora(node)
    }


def merged_weight(adapter: LoraLinear) -> Float[Array, "*layers d_out d_in"]:
    """The base weight plus scale * B A, computed in fp32 and cast back."""
    a = adapter.lora_a.weight.astype(jnp.float32)
    b = adapter.lora_b.weight.astype(jnp.float32)
    delta = jnp.einsum("...or,...ri->...oi", b, a, precision=jax.lax.Precision.HIGHEST)
    base = adapter.base.weight
    return (base.astype(jnp.float32) + adapter.scale * delta).astype(base.dtype)


def merge(model):
    """A plain model: every adapter folded into its base weight (W + scale * B A)."""
    if not adapters(model):
        return model

    def fold(node):
        if not is_lora(node):
            return node
        return eqx.tree_at(lambda m: m.weight, node.base, merged_weight(node))

    return jax.tree.map(fold, model, is_leaf=is_lora)


def trainable(model):
    """A pytree of bools like `model`: what a training step differentiates and updates.

    With adapters, only their A and B matrices (the base is frozen: no gradients, no optimizer
    state); without, every floating-point array (full fine-tuning, pretraining).
    """
    if not adapters(model):
        return jax.tree.map(eqx.is_inexact_array, model)

    def mark(path, leaf) -> bool:
        names = {getattr(k, "name", None) for k in path}
        return eqx.is_inexact_array(leaf) and bool(names & {"lora_a", "lora_b"})

    return jax.tree_util.tree_map_with_path(mark, model)


def with_dropout_keys(model, key: PRNGKeyArray | None):
    """`model` with a dropout key in every adapter that has dropout (one per stacked layer), or
    with them removed (`key` None). The training step sets them for its forward pass only."""
    found = [a for a in adapters(model).values() if a.dropout > 0]
    if not found:
        return model

    def keys(i: int, adapter: LoraLinear):
        if key is None:
            return None
        return jax.random.split(jax.random.fold_in(key, i), adapter.lora_a.weight.shape[:-2])

    ids = {id(a): i for i, a in enumerate(found)}
    return jax.tree.map(
        lambda n: (
            eqx.tree_at(lambda m: m.key, n, keys(ids[id(n)], n), is_leaf=lambda x: x is None)
            if is_lora(n) and id(n) in ids
            else n
        ),
        model,
        is_leaf=is_lora,
    )


def disabled(model):
    """`model` with every adapter switched off: its base layers, the same arrays (no copy).

    What the frozen starting model computes, for a reference in preference or RL training.
    """
    return jax.tree.map(lambda n: n.base if is_lora(n) else n, model, is_leaf=is_lora)
