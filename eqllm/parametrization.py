"""How initialisation, learning rates and forward multipliers follow width and depth.

Three parametrizations (docs/scaling-laws.md has the table and the reasons):

- "sp", the standard one: what every recipe did before; nothing depends on a base size.
- "mup", maximal update parametrization for Adam in the MuReadout form that works with tied
  embeddings (Yang et al. 2022, Tensor Programs V; microsoft/mup). With m = d_model /
  base_d_model: hidden matrices start at std / sqrt(m) and take Adam learning rate lr / m, Adam
  eps / m and weight decay x m (AdamW and Lion; Adafactor and Muon take their own hidden
  factor, `UPDATE_KINDS`); the readout's logits are multiplied by output_mult / m;
  embeddings, norms and biases keep SP's init and learning rate; attention scores are scaled by
  sqrt(base_head_dim) / head_dim (1 / head_dim up to a constant) when head_dim grows with width.
- "completep", muP plus depth transfer (Dey et al. 2025, alpha = 1): with k = n_layers /
  base_n_layers each residual branch is multiplied by 1 / k, the "residual" init role loses its
  1 / sqrt(2 n_layers) factor (it keeps base_n_layers' constant), hidden matrices take Adam eps
  / (m k); learning rates follow muP's (the depth factor k^(alpha - 1) is 1).

A parameter's role comes from its layer's logical axes (`eqllm.nn.param_info`): "hidden" when
both of its dimensions grow with width, "readout" when only its input does, "embedding" when
only its output does, "vector" for biases and norm scales. Every width axis (d_model, d_ff,
heads, kv_heads) is assumed to grow in proportion to d_model, so one ratio m serves them all.
At m = 1 (and k = 1) every multiplier is exactly 1.0 and the model equals SP bit for bit.

Nothing here needs eqllm's model: `Scales.of` takes plain sizes, and `init_weights` and
`multipliers` walk any tree of eqllm layers. `scales(config)` reads a `ModelConfig`'s fields,
which is how `CausalLM` (and a recipe) get theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from eqllm.config import ModelConfig, Parametrization
from eqllm.errors import EqllmError
from eqllm.nn import param_info
from eqllm.nn.params import is_param_info


@dataclass(frozen=True)
class Scales:
    """The ratios and forward multipliers of one model (all 1.0 under SP); build with `Scales.of`
    from plain sizes, or `scales(config)` from a ModelConfig."""

    kind: str
    width: float  # m = d_model / base_d_model
    depth: float  # k = n_layers / base_n_layers (CompleteP; 1 otherwise)
    readout: float  # multiplies the logits: output_mult / m (muP, CompleteP)
    branch: float  # multiplies each residual branch: 1 / k (CompleteP)
    attention: float  # multiplies the usual attention scale
    residual_init_layers: int  # the n_layers in the "residual" role's 1 / sqrt(2 n_layers)

    @classmethod
    def of(
        cls,
        kind: Parametrization = "sp",
        *,
        n_layers: int,
        d_model: int | None = None,
        base_d_model: int | None = None,
        base_n_layers: int | None = None,
        output_mult: float = 1.0,
        head_dim_grows: bool = True,
    ) -> Scales:
        """The scales of a model of `n_layers` blocks and width `d_model` under `kind`.

        Arguments:
            kind: "sp", "mup" or "completep".
            n_layers: the blocks (residual branch pairs) of the model.
            d_model: its width (needed by muP and CompleteP).
            base_d_model: the width at which muP / CompleteP equal SP (None: `d_model`).
            base_n_layers: the depth at which CompleteP equals muP (None: `n_layers`); muP
                does not read it.
            output_mult: multiplies the readout's logits (muP's tunable output multiplier).
            head_dim_grows: whether head_dim grows with the width (n_heads fixed), so that
                attention scores take muP's 1 / head_dim; False keeps 1 / sqrt(head_dim).
        """
        if kind not in ("sp", "mup", "completep"):
            raise EqllmError(f"parametrization={kind!r}: choose 'sp', 'mup' or 'completep'")
        for name, value in (("n_layers", n_layers), ("base_n_layers", base_n_layers)):
            if value is not None and not (isinstance(value, int) and value > 0):
                raise EqllmError(f"{name}={value!r} must be a positive integer")
        if kind == "sp":
            return cls("sp", 1.0, 1.0, 1.0, 1.0, 1.0, n_layers)
        if d_model is None:
            raise EqllmError(
                f"parametrization={kind!r} needs d_model (the width it scales by d_model / "
                "base_d_model)"
            )
        m = d_model / (base_d_model or d_model)
        base_layers = (base_n_layers or n_layers) if kind == "completep" else n_layers
        k = n_layers / base_layers
        return cls(
            kind=kind,
            width=m,
            depth=k,
            readout=output_mult / m,
            branch=1.0 / k,
            attention=1.0 / math.sqrt(m) if head_dim_grows else 1.0,
            residual_init_layers=base_layers,
        )


@dataclass(frozen=True)
class Multipliers:
    """Per-parameter factors on SP's init std, Adam learning rate, Adam eps and weight decay."""

    init: float = 1.0
    lr: float = 1.0
    eps: float = 1.0
    decay: float = 1.0


def scales(cfg: ModelConfig) -> Scales:
    """The scales of a config: the one place that reads its parametrization fields."""
    return Scales.of(
        cfg.parametrization,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        base_d_model=cfg.base_d_model,
        base_n_layers=cfg.base_n_layers,
        output_mult=cfg.output_mult,
        # head_dim grows with width when it is derived from d_model (n_heads fixed); a family
        # that fixes head_dim and adds heads instead keeps the usual 1 / sqrt(head_dim).
        head_dim_grows=cfg.head_dim * cfg.attention.n_heads == cfg.d_model,
    )


# How an optimizer sizes a hidden matrix's step, which fixes muP's learning-rate factor for it:
# "adam": entrywise-normalised (AdamW, Lion): a low-rank gradient's step moves an output by
#   lr x fan_in, so lr / m; "relative" (Adafactor): the step is lr x the matrix's RMS, which
#   muP's init already shrinks by 1 / sqrt(m), so lr / sqrt(m); "spectral" (Muon, "original"
#   scale): an orthogonalised step of spectral norm lr x sqrt(max(1, fan_out / fan_in)), the
#   same at every width, so lr; "spectral_rms" (Muon, "match_rms_adamw"): spectral norm
#   lr x 0.2 x sqrt(max(fan_in, fan_out)), which grows as sqrt(m), so lr / sqrt(m).
UPDATE_KINDS = ("adam", "relative", "spectral", "spectral_rms")


def role_multipliers(s: Scales, role: str, update: str = "adam") -> Multipliers:
    """The factors for a parameter of `role` under scales `s` (the docs' table), for an
    optimizer whose hidden steps are sized as `update` says (`UPDATE_KINDS`)."""
    if update not in UPDATE_KINDS:
        raise EqllmError(f"update={update!r}: choose one of {', '.join(UPDATE_KINDS)}")
    if s.kind == "sp" or role != "hidden":
        return Multipliers()
    m, k = s.width, s.depth
    # how the step's effect on a layer's output grows with m; the learning rate divides it out
    grow = {"adam": m, "relative": math.sqrt(m), "spectral": 1.0, "spectral_rms": math.sqrt(m)}
    grow = grow[update]
    # Adam's eps sits beside gradients that shrink as 1 / m (muP) or 1 / (m k) (CompleteP);
    # the other optimizers have no such eps.
    eps = (1.0 / m if s.kind == "mup" else 1.0 / (m * k)) if update == "adam" else 1.0
    # optax's optimizers decay by lr x weight_decay: with the learning rate x lr the decay must
    # be / lr, or the hidden weights' decay per step would change with width.
    return Multipliers(init=1.0 / math.sqrt(m), lr=1.0 / grow, eps=eps, decay=grow)


def roles(tree: PyTree) -> PyTree:
    """A pytree like `tree` with the width role of every array ("hidden", "readout",
    "embedding" or "vector"), from its layer's logical axes (`eqllm.nn.param_info`)."""
    return jax.tree.map(lambda info: info.role, param_info(tree), is_leaf=is_param_info)


def multipliers(tree: PyTree, s: Scales) -> PyTree:
    """A pytree like `tree` with the `Multipliers` of every array under scales `s`: the factors
    an optimizer applies per parameter (`eqllm.train.make_optimizer`) and `init_weights` applies
    to the init std."""
    return jax.tree.map(lambda role: role_multipliers(s, role), roles(tree))


def init_weights(
    tree: PyTree,
    key: PRNGKeyArray,
    *,
    scales: Scales | None = None,
    n_layers: int | None = None,
    init_std: float = 0.02,
):
    """The one place where initial weights are chosen (GPT-2 scheme, as in nanoGPT).

    Walks the layers' own metadata (`eqllm.nn.param_info`), so any tree of eqllm layers works:
    - weights with role "normal" (embeddings, q/k/v, MLP inputs, the head) ~ N(0, init_std):
      small enough that logits start near uniform, large enough to break symmetry;
    - weights with role "residual" (attention out, MLP down) ~ N(0, init_std / sqrt(2 L)): each
      of the 2L residual branches adds variance, this keeps the stream's variance O(1) in depth;
    - biases 0; every other array (norm scales: 1, or 0 in Gemma's (1 + w) form) keeps the
      value its layer gave it, which starts the layer as the identity.

    Under muP / CompleteP (`scales`) hidden matrices' std is divided by sqrt(width ratio), and
    CompleteP's residual role uses base_n_layers instead of n_layers.

    Arguments:
        tree: a model, or any pytree of eqllm layers.
        key: one draw per array is split from it.
        scales: the parametrization (`Scales.of`, or `scales(config)`); or, for SP, give
            `n_layers` (the L above) instead.
        init_std: the std of the "normal" role.
    """
    if (scales is None) == (n_layers is None):
        raise EqllmError(
            "init_weights takes scales=Scales.of(...) or, for the standard parametrization, "
            f"n_layers (the residual init divides by sqrt(2 n_layers)); got scales={scales!r}, "
            f"n_layers={n_layers!r}"
        )
    s = Scales.of("sp", n_layers=n_layers) if scales is None else scales
    layers = s.residual_init_layers
    std = {"normal": init_std, "residual": init_std / math.sqrt(2 * layers)}
    infos, treedef = jax.tree.flatten(param_info(tree), is_leaf=is_param_info)
    arrays = treedef.flatten_up_to(tree)
    keys = jax.random.split(key, len(arrays))

    def draw(k, x, info):
        if info.init == "zeros":
            return jnp.zeros_like(x)
        if info.init is None:
            return x
        sigma = std[info.init] * role_multipliers(s, info.role).init
        return (sigma * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)

    return jax.tree.unflatten(treedef, list(map(draw, keys, arrays, infos)))
