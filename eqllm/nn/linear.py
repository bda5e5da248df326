"""Linear and embedding layers that carry their parameters' metadata.

Each layer knows the logical names of its weight's axes (`("heads", "d_model")`: the query
projection's output is split into heads, its input is the model width) and its initialisation
role. Sharding, initialisation and the weight-decay mask are derived from these by walking the
model (`eqllm.nn.params.param_info`), so no table keyed by parameter path has to agree with
the model code.

The product itself runs as one 2-D matrix product over every row of a (possibly batched)
sequence: see `rows_times`.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8, PRNGKeyArray

from eqllm.errors import EqllmError
from eqllm.nn.grouped import megablox_matmul

# The logical axis names of eqllm's layers; `eqllm.sharding` maps each to mesh axes.
# "per_layer": the per-layer inputs' axis (`eqllm.nn.per_layer`), fixed as width grows.
Axis = Literal["vocab", "d_model", "heads", "kv_heads", "d_ff", "positions", "expert", "per_layer"]
# How a weight starts (see `eqllm.parametrization.init_weights`): "normal" draws N(0, std);
# "residual" draws N(0, std / sqrt(2 * layers)) for projections that write into the residual
# stream.
InitRole = Literal["normal", "residual"]
# How a parameter scales with width (muP, eqllm.parametrization), from its axes alone: "hidden"
# when input and output grow with the width, "readout" when only the input does (the LM head),
# "embedding" when only the output does (token and position tables), "vector" otherwise.
Role = Literal["embedding", "hidden", "readout", "vector"]
WIDTH_AXES = frozenset({"d_model", "d_ff", "heads", "kv_heads"})


def role_of(axes: tuple[str | None, ...]) -> Role:
    """The width role of a weight whose last two axes are (output, input)."""
    if len(axes) < 2:
        return "vector"
    out_wide, in_wide = axes[-2] in WIDTH_AXES, axes[-1] in WIDTH_AXES
    if out_wide and in_wide:
        return "hidden"
    if in_wide:
        return "readout"
    return "embedding" if out_wide else "vector"


def rows_times(x: Float[Array, "*rows d_in"], weight: Float[Array, "d_out d_in"], **kwargs):
    """x @ weight^T over the last axis, with every leading axis folded into one row axis.

    Same values as `jnp.einsum("...i,oi->...o", x, weight)`; but with two or more row axes
    (batch and sequence) the weight gradient contracts over several axes, and XLA's CPU backend
    then transposes the activations and their gradients through slow copies before the matrix
    product (measured: a llama-mini MLP's forward and backward 237 ms vs 165 ms as one 2-D
    product). `kwargs` go to `jnp.einsum` (e.g. `preferred_element_type`).
    """
    rows = x.reshape(-1, x.shape[-1])
    y = jnp.einsum("ti,oi->to", rows, weight, **kwargs)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Linear(eqx.Module):
    """y = x W^T (+ b) over the last axis of `x`, whatever its leading axes.

    Arguments:
        in_features: size of the input.
        out_features: size of the output.
        axes: logical names of the output and input axes, e.g. `("d_ff", "d_model")`.
        use_bias: learn an additive bias.
        init: initialisation role, "normal" or "residual" (see `InitRole`).

    The weight is stored (out, in), as Hugging Face checkpoints store it.
    """

    weight: Float[Array, "d_out d_in"]
    bias: Float[Array, " d_out"] | None
    axes: tuple[Axis | None, Axis | None] = eqx.field(static=True)
    init: InitRole = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[Axis | None, Axis | None],
        use_bias: bool = False,
        init: InitRole = "normal",
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        # Placeholder values: `eqllm.parametrization.init_weights` draws the real ones by
        # `init`; a layer used on its own gets a small normal draw that is already usable.
        self.weight = (0.02 * jax.random.normal(key, (out_features, in_features))).astype(dtype)
        self.bias = jnp.zeros(out_features, dtype) if use_bias else None
        self.axes = axes
        self.init = init

    @jax.named_scope("eqllm.Linear")
    def __call__(self, x: Float[Array, "*rows d_in"], **kwargs) -> Float[Array, "*rows d_out"]:
        """`kwargs` go to the product (`preferred_element_type=jnp.float32` for fp32 logits)."""
        y = rows_times(x, self.weight, **kwargs)
        if self.bias is not None:
            y = y + self.bias
        return y


class Int8Linear(Linear):
    """A `Linear` whose weight is stored in int8 with one fp scale per output channel.

    Weight-only quantisation: `weight ~ int8 * scale[:, None]` with `scale = max|w_row| / 127`
    (symmetric, round to nearest), so each row keeps its own range; the activations stay in
    the compute dtype. Build it from a trained layer with `Int8Linear(linear)` (any leading
    `layers` axes are kept), or a whole model with `quantize(model, "int8")`.
    """

    weight: Int8[Array, "d_out d_in"]
    scale: Float[Array, " d_out"]

    def __init__(self, linear: Linear):
        self.weight, self.scale = _int8_rows(linear.weight)
        self.bias = linear.bias
        self.axes = linear.axes
        self.init = linear.init

    @jax.named_scope("eqllm.Int8Linear")
    def __call__(self, x: Float[Array, "*rows d_in"], **kwargs) -> Float[Array, "*rows d_out"]:
        y = int8_times(x, self.weight, self.scale, **kwargs)
        return y if self.bias is None else y + self.bias


def int8_times(x: Float[Array, "*rows d_in"], weight: Int8[Array, "d_out d_in"], scale, **kwargs):
    """x @ (weight * scale[:, None])^T over the last axis, the scale applied to the result.

    Written as `x @ w.T` on purpose: at one row (batch-1 decode) XLA's CPU backend rewrites that
    product into one loop that reads the int8 weight and widens each value in registers, with
    no fp32 copy (the `einsum("ti,oi->to")` of `rows_times` stays a library product on a copy
    widened first: 3.5 MB written and read back per MLP weight of smollm-135m). At more rows
    the weight is widened into a copy; adding a zero computed from the input then makes each
    layer's widening wait for its input, so one buffer is reused rather than every layer's
    weight widened up front (406 MiB of temporaries in smollm-135m's decode before).
    """
    weight = weight + zero_after(jax.lax.stop_gradient(x)).astype(jnp.int8)
    rows = x.reshape(-1, x.shape[-1])
    y = jnp.matmul(rows, weight.astype(x.dtype).T, **kwargs)
    y = y * scale.astype(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@jax.custom_batching.custom_vmap
def zero_after(x: Array) -> Int[Array, ""]:
    """0, computed from `x` in a way XLA cannot fold, so what adds it runs after `x` exists.

    An integer (an argmax clipped at 0), whatever NaN or infinity `x` holds. Under `jax.vmap`
    it stays one unbatched zero from the whole batch, so a weight it is added to is not copied
    per row. `Int8Linear` orders its weight's widening with it, and the serving engine its
    reads of a layer's cache (`eqllm.generation.paged`).
    """
    x = x.reshape(-1)[:2]
    return jnp.minimum(jnp.argmax(x), 0).astype(jnp.int32)


@zero_after.def_vmap
def _zero_after_batched(axis_size, in_batched, x):
    return zero_after(x), False


QUANTIZATIONS = ("int8",)


def quantize(tree, kind: str = "int8"):
    """`tree` (a model, or any tree of layers) with every `Linear` replaced by its `Int8Linear`
    and every vocabulary table (the token embedding, and so a head tied to it) by its
    `Int8Embedding`.

    Position tables, norms and mixture-of-experts weights stay as they are. Merge LoRA
    adapters first (`eqllm.lora.merge`): an adapter's own layers would be quantised too.
    """
    if kind not in QUANTIZATIONS:
        raise EqllmError(f"quantize kind={kind!r}: choose one of {list(QUANTIZATIONS)}")

    def plain(x) -> bool:
        if isinstance(x, Int8Linear | Int8Embedding):
            return False
        return isinstance(x, Linear) or (isinstance(x, Embedding) and x.axes[0] == "vocab")

    def quantized(x):
        return Int8Linear(x) if isinstance(x, Linear) else Int8Embedding(x)

    return jax.tree.map(lambda x: quantized(x) if plain(x) else x, tree, is_leaf=plain)


class Embedding(eqx.Module):
    """A lookup table: row `i` of the weight for token (or position) `i`.

    Arguments:
        num_embeddings: rows of the table.
        dim: size of each row.
        axes: logical names of the row and column axes, e.g. `("vocab", "d_model")`.
    """

    weight: Float[Array, "num dim"]
    axes: tuple[Axis | None, Axis | None] = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        axes: tuple[Axis | None, Axis | None],
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        self.weight = (0.02 * jax.random.normal(key, (num_embeddings, dim))).astype(dtype)
        self.axes = axes

    @jax.named_scope("eqllm.Embedding")
    def __call__(self, ids: Int[Array, "*rows"]) -> Float[Array, "*rows dim"]:
        return jnp.take(self.weight, ids, axis=0)

    @jax.named_scope("eqllm.Embedding.attend")
    def attend(self, x: Float[Array, "*rows dim"], **kwargs) -> Float[Array, "*rows num"]:
        """x against every row of the table: the LM head of a model tied to its embedding."""
        return rows_times(x, self.weight.astype(x.dtype), **kwargs)


class Int8Embedding(Embedding):
    """An `Embedding` stored in int8 with one fp scale per row (`Int8Linear`'s rounding).

    A lookup gathers int8 rows and scales them; `attend` (the head of a tied model) is the
    int8 product of `int8_times`, each row's scale being its logit's. Build it from a table
    with `Int8Embedding(embedding)`, or a whole model with `quantize(model, "int8")`.
    """

    weight: Int8[Array, "num dim"]
    scale: Float[Array, " num"]

    def __init__(self, embedding: Embedding):
        self.weight, self.scale = _int8_rows(embedding.weight)
        self.axes = embedding.axes

    @jax.named_scope("eqllm.Int8Embedding")
    def __call__(self, ids: Int[Array, "*rows"]) -> Float[Array, "*rows dim"]:
        rows = jnp.take(self.weight, ids, axis=0).astype(self.scale.dtype)
        return rows * jnp.take(self.scale, ids, axis=0)[..., None]

    @jax.named_scope("eqllm.Int8Embedding.attend")
    def attend(self, x: Float[Array, "*rows dim"], **kwargs) -> Float[Array, "*rows num"]:
        return int8_times(x, self.weight, self.scale, **kwargs)


def _int8_rows(weight: Array) -> tuple[Array, Array]:
    """Symmetric int8 rows, `weight ~ int8 * scale[..., None]`, scale = max|row| / 127."""
    w = weight.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero row keeps scale 1
    q = jnp.clip(jnp.round(w / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale.astype(weight.dtype)


class ExpertLinear(eqx.Module):
    """`n` independent linear layers stacked on a leading `expert` axis (mixture of experts).

    Arguments:
        n: number of experts.
        in_features: size of each expert's input.
        out_features: size of each expert's output.
        axes: logical names of the output and input axes; the leading axis is "expert".
        init: initialisation role (see `InitRole`).
        use_bias: learn an additive bias per expert (gpt-oss), stored (n, out).

    The weight is stored (n, out, in), as transformers 5 stores its fused experts.
    """

    weight: Float[Array, "n d_out d_in"]
    bias: Float[Array, "n d_out"] | None
    axes: tuple[Axis | None, Axis | None, Axis | None] = eqx.field(static=True)
    init: InitRole = eqx.field(static=True)

    def __init__(
        self,
        n: int,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[Axis | None, Axis | None],
        init: InitRole = "normal",
        use_bias: bool = False,
        key: PRNGKeyArray,
        dtype=jnp.float32,
    ):
        shape = (n, out_features, in_features)
        self.weight = (0.02 * jax.random.normal(key, shape)).astype(dtype)
        self.bias = jnp.zeros((n, out_features), dtype) if use_bias else None
        self.axes = ("expert", *axes)
        self.init = init

    @jax.named_scope("eqllm.ExpertLinear")
    def __call__(self, x: Float[Array, "n rows d_in"]) -> Float[Array, "n rows d_out"]:
        """Every expert on its own rows (all experts on all tokens, for the dense product)."""
        y = jnp.einsum("eti,eoi->eto", x, self.weight)
        return y if self.bias is None else y + self.bias[:, None, :]

    @jax.named_scope("eqllm.ExpertLinear.grouped")
    def grouped(
        self,
        x: Float[Array, "rows d_in"],
        group_sizes: Int[Array, " n"],
        kernel: str = "xla",
        *,
        interpret: bool = False,
    ) -> Float[Array, "rows d_out"]:
        """Rows sorted by expert, `group_sizes[e]` of them for expert e (rows past the groups
        are padding: zeros, plus the last expert's bias if it has one, as ragged_dot gives).

        `kernel` "xla" is `jax.lax.ragged_dot`; "megablox" is TPU's grouped-matmul kernels,
        the weights' gradient grouped too (`eqllm.nn.grouped`). `interpret` runs them in
        Pallas' interpreter (any backend: tests)."""
        if kernel == "megablox":
            y = megablox_matmul(x, self.weight, group_sizes, interpret=interpret)
        else:
            # 16-bit operands multiply exactly at any precision, and TPU's grouped-matmul kernel
            # refuses them at "highest" (Mosaic: "Bad lhs type"), which a global
            # jax_default_matmul_precision may ask for: ask for the default there.
            precision = jax.lax.Precision.DEFAULT if x.dtype.itemsize < 4 else None
            w = jnp.swapaxes(self.weight, 1, 2)
            y = jax.lax.ragged_dot(x, w, group_sizes, precision=precision)
        if self.bias is None:
            return y
        # Row r belongs to the expert whose group covers it: each bias repeated over its group.
        return y + jnp.repeat(self.bias, group_sizes, axis=0, total_repeat_length=x.shape[0])
