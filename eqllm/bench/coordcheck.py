"""The coordinate check (Yang et al. 2022, Tensor Programs V, appendix D.1): train a model at
several widths (or depths) a few optimizer steps at a large learning rate and see how the size
of its activations grows. Under a parametrization that transfers, the mean |activation| of
every layer stays put as the width grows (slope ~0 against log2 width); under SP the hidden
layers' outputs grow with it after the first update (slope ~1).

Run it first after changing a layer: a slope away from 0 under muP names the layer that breaks
transfer, before any sweep is paid for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqllm import zoo
from eqllm.config import ModelConfig
from eqllm.errors import EqllmError
from eqllm.model import CausalLM
from eqllm.nn import GatedDeltaNet, Mamba2
from eqllm.recipe import OptimSpec
from eqllm.train.optim import make_optimizer, schedule
from eqllm.train.step import TrainStep, init_opt_state

# The check's learning rate per optimizer: large enough that a hidden layer's update is a good
# part of its initial output within the 3 steps (what makes the check able to fail), no larger.
# Adafactor's is a relative step (lr x the weights' RMS).
CHECK_LR = {"adamw": 1e-2, "lion": 1e-2, "muon": 1e-2, "adafactor": 1e-1}


@dataclass(frozen=True)
class CoordCheck:
    """Mean |activation| per name, size and step; the least-squares slopes of their log2."""

    axis: str  # "width" or "depth"
    sizes: tuple[int, ...]
    means: dict[str, np.ndarray]  # name -> [size, step]
    slopes: dict[str, list[float]]  # name -> slope at each step

    def to_json(self) -> dict:
        return {
            "axis": self.axis,
            "sizes": list(self.sizes),
            "slopes": self.slopes,
            "means": {k: v.tolist() for k, v in self.means.items()},
        }


def sized_config(
    variant: str,
    parametrization: str,
    *,
    width: int,
    depth: int | None,
    base_width: int,
    base_depth: int | None,
    vocab_size: int,
    seq_len: int,
) -> ModelConfig:
    """The variant at `width` (d_ff in proportion, n_heads fixed so head_dim grows, and a linear
    layer's head sizes with it) and depth."""
    cfg = zoo.config(variant)
    d_ff = max(1, round(cfg.mlp.d_ff * width / cfg.d_model))
    changes = {
        "d_model": width,
        "mlp.d_ff": d_ff,
        "attention.head_dim": None,
        "vocab_size": vocab_size,
        "max_seq_len": seq_len,
        "parametrization": parametrization,
        "scan_layers": True,
    }
    if cfg.linear is not None:  # linear-attention heads grow with the width, as attention's
        # (Mamba-2's key_head_dim is its state size, which its sizes keep fixed: not a width)
        dims = (
            ("value_head_dim",)
            if cfg.linear.kind == "mamba2"
            else ("key_head_dim", "value_head_dim")
        )
        for dim in dims:
            changes[f"linear.{dim}"] = max(1, round(getattr(cfg.linear, dim) * width / cfg.d_model))
    if depth is not None:
        changes["n_layers"] = depth
    if parametrization != "sp":
        changes["base_d_model"] = base_width
        if parametrization == "completep":
            changes["base_n_layers"] = base_depth or changes.get("n_layers", cfg.n_layers)
    return cfg.replace(**changes)


def activations(model: CausalLM, tokens) -> tuple[dict[str, jax.Array], jax.Array]:
    """(mean |x| by name, logits): mean |x| of the embedding output, the first and the last
    layer's attention and MLP outputs (before the residual add and any branch multiplier), the
    final residual stream and the logits.

    Walks the layers as `Block.routed` does; the logits equal `model(tokens)`'s."""
    cfg = model.config
    for field in ("per_layer", "attention.kv_shared_layers"):  # not walked here
        if cfg.at(field) is not None:
            raise EqllmError(
                f"coordcheck does not walk {field}={cfg.at(field)} yet (per-layer inputs, "
                "kv-shared layers); set it to None for the coordinate check"
            )
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    means = {}
    x = model.embed_inputs(tokens, positions)
    means["embed"] = jnp.mean(jnp.abs(x))
    n = model.config.n_layers
    for i, block in enumerate(model.layers()):
        tag = str(i) if i < n - 1 else "last"
        h = x if block.attn_norm is None else block.attn_norm(x)
        if isinstance(block.attn, GatedDeltaNet | Mamba2):  # recurrent: (output, state)
            a = block.attn(h, None, None)[0]
        else:
            a = block.attn(h, None, None)
        a = a if block.attn_post_norm is None else block.attn_post_norm(a)
        mlp_in = x if block.parallel else x + a * block.branch_scale
        x = x + a * block.branch_scale
        if i == 0 or tag == "last":
            means[f"attn.{tag if i else 0}"] = jnp.mean(jnp.abs(a))
        if block.mlp is None:  # norm -> mixer -> residual (Mamba-2's blocks): no MLP output
            continue
        h = mlp_in if block.mlp_norm is None else block.mlp_norm(mlp_in)
        f = block.mlp(h)
        f = f if block.mlp_post_norm is None else block.mlp_post_norm(f)
        x = x + f * block.branch_scale
        if i == 0 or tag == "last":
            means[f"mlp.{tag if i else 0}"] = jnp.mean(jnp.abs(f))
    means["residual"] = jnp.mean(jnp.abs(x))
    logits = model.logits(model.final_norm(x))
    means["logits"] = jnp.mean(jnp.abs(logits))
    return means, logits


def coord_check(
    variant: str,
    parametrization: str,
    *,
    widths: tuple[int, ...],
    depths: tuple[int, ...] | None = None,
    steps: int = 3,
    lr: float | None = None,
    batch: int = 2,
    seq_len: int = 8,
    vocab_size: int = 256,
    seeds: int = 3,
    seed: int = 0,
    init_std: float | None = None,
    zero_readout: bool | None = None,
    optimizer: str = "adamw",
) -> CoordCheck:
    """Train each size `steps` steps of `optimizer` (no warmup, no clipping, no decay; its other
    settings `OptimSpec`'s defaults) on one fixed random batch and record `activations` after
    every step; each mean |activation| is the average over `seeds` runs (initialisation and
    batch drawn from seed, seed + 1, ...). The defaults are microsoft/mup's check (3 steps at
    lr 1e-2, fan-in init, a zero head), which a correct muP passes at 64-256 wide; `lr` None
    takes the optimizer's `CHECK_LR`.

    The batch is small on purpose: muP's limit holds the batch fixed as the width grows, and an
    update's effect on a layer's output only reaches its large-width size once the width is
    well above the number of distinct tokens (`batch * seq_len`); with more tokens than width
    the update acts like a random matrix and every slope sits below 0 (docs/scaling-laws.md).

    `init_std` replaces the variant's; None takes 1 / sqrt(base width), microsoft/mup's fan-in
    init (the variant's 0.02, far below it, leaves every layer's output to its updates, whose
    large-width size is reached only at larger widths). `zero_readout` starts the LM head at
    zero, as microsoft/mup's examples do, which removes the logits' initial part (it shrinks as
    1 / sqrt(width) under muP, correctly, but dominates the logits of a few steps at small
    widths); None zeroes it when the head is untied, and True with a tied head is refused.
    """
    axis = "depth" if depths else "width"
    sizes = tuple(depths) if depths else tuple(widths)
    spec = OptimSpec(
        name=optimizer,
        lr=CHECK_LR[optimizer] if lr is None else lr,
        warmup_steps=0,
        schedule="constant",
        weight_decay=0.0,
        clip_norm=0.0,
    )
    std = init_std if init_std is not None else 1.0 / widths[0] ** 0.5
    measure = jax.jit(lambda model, t: activations(model, t)[0])
    table: dict[str, list[list[float]]] = {}
    for size in sizes:
        cfg = sized_config(
            variant,
            parametrization,
            width=widths[0] if depths else size,
            depth=size if depths else None,
            base_width=widths[0],
            base_depth=sizes[0] if depths else None,
            vocab_size=vocab_size,
            seq_len=seq_len,
        )
        cfg = cfg.replace(init_std=std)
        if zero_readout and cfg.tie_embeddings:
            raise EqllmError(
                f"zero_readout with {variant} (tie_embeddings = true) would zero the embedding; "
                "check an untied variant or leave the head's initialisation as it is"
            )
        zero_head = not cfg.tie_embeddings if zero_readout is None else zero_readout
        rows: dict[str, np.ndarray] = {}
        step = None
        for s in range(seed, seed + seeds):
            model = CausalLM(cfg, key=jax.random.key(s))
            if zero_head:
                model = eqx.tree_at(lambda m: m.lm_head.weight, model, model.lm_head.weight * 0)
            tokens = jax.random.randint(jax.random.key(s), (batch, seq_len), 0, vocab_size)
            if step is None:  # one optimizer and compiled step per size, shared by its seeds
                step = TrainStep(make_optimizer(spec, steps, model), schedule(spec, steps))
            state = init_opt_state(step.optimizer, model)
            for t in range(steps):
                model, state, _ = step(model, state, tokens)
                for name, value in measure(model, tokens).items():
                    rows.setdefault(name, np.zeros(steps))[t] += float(value) / seeds
        for name, values in rows.items():
            table.setdefault(name, []).append(list(values))
    x = np.log2(np.asarray(sizes, np.float64))
    means = {k: np.asarray(v) for k, v in table.items()}
    slopes = {
        k: [float(np.polyfit(x, np.log2(v[:, s]), 1)[0]) for s in range(v.shape[1])]
        for k, v in means.items()
    }
    return CoordCheck(axis, sizes, means, slopes)


def plot_coord_check(result: CoordCheck, path: Path, title: str) -> Path:
    """coord_check.png: log2 mean |activation| against log2 size, one panel per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_steps = len(next(iter(result.slopes.values())))
    fig, axes = plt.subplots(1, n_steps, figsize=(3.2 * n_steps, 3.4), sharey=True, squeeze=False)
    for s, ax in enumerate(axes[0]):
        for name, values in result.means.items():
            ax.plot(result.sizes, values[:, s], "o-", ms=3, label=name)
        ax.set(xscale="log", yscale="log", title=f"after step {s + 1}", xlabel=result.axis)
        ax.minorticks_off()  # the sizes label the axis, not log-scale minor ticks
        ax.set_xticks(result.sizes, [str(v) for v in result.sizes])
    axes[0][0].set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
