"""Loss-curvature and gradient-noise diagnostics at a checkpoint.

- Top Hessian eigenvalue, by power iteration on Hessian-vector products (forward-over-reverse:
  `jax.jvp` of `jax.grad`, never forming the Hessian). With plain gradient descent a step is
  stable only when lr < 2 / lambda_max; Adam's preconditioned version of that bound explains
  loss spikes when the learning rate outgrows the curvature (Cohen et al., 2021, "edge of
  stability").
- Gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al., 2018, appendix A): the
  batch size around which doubling the batch stops halving the number of steps. Estimated without
  bias from the squared norms of per-micro-batch gradients and of their mean.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from eqllm.data import batch_at
from eqllm.errors import EqllmError
from eqllm.eval.loss import mean_loss
from eqllm.model import CausalLM
from eqllm.recipe import prepare_corpus
from eqllm.runs import MissingRunFile, RunFolder

Loss = Callable[[PyTree, Any], Float[Array, ""]]


def _dot(a, b) -> Float[Array, ""]:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _scale(tree, s):
    return jax.tree.map(lambda x: x * s, tree)


def hvp(loss_fn: Loss, params: PyTree, batch: Any, v: PyTree) -> PyTree:
    """H v, H the Hessian of `loss_fn(., batch)` at `params` (jvp of grad)."""
    return jax.jvp(lambda p: jax.grad(loss_fn)(p, batch), (params,), (v,))[1]


def hessian_top_eigenvalue(
    loss_fn: Loss,
    params: PyTree,
    batch: Any,
    *,
    key: PRNGKeyArray,
    iters: int = 20,
    tol: float = 1e-3,
) -> tuple[float, list[float]]:
    """(eigenvalue of largest magnitude, its estimate at every iteration).

    Power iteration v <- Hv / |Hv| from a random start; the estimate is the Rayleigh quotient
    v.Hv. Stops after `iters` products or when it changes by less than `tol` (relative).
    `loss_fn(params, batch)` returns a scalar; `params` is a pytree of float arrays.
    """
    step = jax.jit(lambda p, b, v: hvp(loss_fn, p, b, v))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    v = jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ],
    )
    v = _scale(v, 1.0 / jnp.sqrt(_dot(v, v)))
    history: list[float] = []
    for _ in range(iters):
        hv = step(params, batch, v)
        history.append(float(_dot(v, hv)))
        norm = jnp.sqrt(_dot(hv, hv))
        if float(norm) == 0.0:
            break
        v = _scale(hv, 1.0 / norm)
        if len(history) > 1 and abs(history[-1] - history[-2]) <= tol * abs(history[-1]):
            break
    return history[-1], history


def gradient_noise_scale(
    loss_fn: Loss, params: PyTree, micro_batches: Any, micro_size: int
) -> dict[str, float]:
    """B_simple = tr(Sigma) / |G|^2 from n micro-batch gradients (McCandlish et al., A.1).

    Arguments:
        loss_fn: `loss_fn(params, micro_batch)`, the mean loss over one micro-batch.
        micro_batches: a pytree whose leaves have a leading axis of n >= 2 micro-batches.
        micro_size: examples per micro-batch (the unit of the returned batch sizes).

    With b = micro_size, B = n b, |G_b|^2 the mean squared norm of the micro-batch gradients and
    |G_B|^2 that of their mean: |G|^2 ~ (B |G_B|^2 - b |G_b|^2) / (B - b) and
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B), both unbiased. Returns those and b_simple
    (nan when the |G|^2 estimate is not positive: noise swamps the signal at this batch size).
    """
    n = jax.tree.leaves(micro_batches)[0].shape[0]
    if n < 2:
        raise EqllmError(f"gradient_noise_scale needs at least 2 micro-batches, got {n}")

    @jax.jit
    def sums(p, mbs):
        def body(carry, mb):
            g_sum, sq_sum = carry
            g = jax.grad(loss_fn)(p, mb)
            return (jax.tree.map(jnp.add, g_sum, g), sq_sum + _dot(g, g)), None

        zeros = jax.tree.map(jnp.zeros_like, p)
        (g_sum, sq_sum), _ = jax.lax.scan(body, (zeros, jnp.zeros(())), mbs)
        g_mean = _scale(g_sum, 1.0 / n)
        return sq_sum / n, _dot(g_mean, g_mean)

    small_sq, big_sq = (float(x) for x in sums(params, micro_batches))
    b, big = float(micro_size), float(micro_size * n)
    grad_sq = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big)
    return {
        "grad_sq": grad_sq,
        "trace_sigma": trace,
        "b_simple": trace / grad_sq if grad_sq > 0 else math.nan,
        "micro_batch": micro_size,
        "n_micro_batches": n,
    }


def analyze_model(
    model: CausalLM,
    batch: Int[Array, "batch window"],
    *,
    micro_batch: int = 2,
    iters: int = 20,
    key: PRNGKeyArray | None = None,
) -> dict[str, Any]:
    """Hessian top eigenvalue (on the whole `batch`) and B_simple (its `micro_batch` splits)."""
    if batch.shape[0] % micro_batch or batch.shape[0] // micro_batch < 2:
        raise EqllmError(
            f"batch of {batch.shape[0]} sequences must split into >= 2 micro-batches of "
            f"{micro_batch}; use a larger batch or a smaller micro_batch"
        )
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(p, b):
        return mean_loss(eqx.combine(p, static), b)

    batch = jnp.asarray(batch)
    key = jax.random.key(0) if key is None else key
    top, history = hessian_top_eigenvalue(loss_fn, params, batch, key=key, iters=iters)
    micro = batch.reshape(-1, micro_batch, batch.shape[-1])
    noise = gradient_noise_scale(loss_fn, params, micro, micro_batch)
    seq = batch.shape[-1] - 1
    return {
        "loss": float(loss_fn(params, batch)),
        "hessian_top_eigenvalue": top,
        "hessian_iterations": history,
        "gd_stable_lr_bound": 2.0 / top if top > 0 else math.inf,
        "noise_scale": {**noise, "b_simple_tokens": noise["b_simple"] * seq},
        "batch": int(batch.shape[0]),
        "seq_len": seq,
    }


def analyze_run(
    run_dir: str | Path,
    *,
    step: int | None = None,
    batch_size: int | None = None,
    micro_batch: int = 2,
    iters: int = 20,
) -> dict[str, Any]:
    """`analyze_model` at a run's checkpoint (default latest) on training batches of its data.

    Writes `analysis.json` (or `analysis-<step>.json`) into the run folder and returns it.
    """
    run_dir = Path(run_dir)
    folder = RunFolder(run_dir)
    if not (run_dir / RunFolder.CONFIG_FILE).exists():
        raise MissingRunFile(
            f"{run_dir} is not a run folder (no config.toml); give the --out folder of `eqllm run`"
        )
    recipe = folder.recipe()
    recipe.check_inputs()  # the training batches are the run's data: it must be here
    model, meta = folder.load_model(step)
    data = prepare_corpus(recipe, progress=False)
    at = int(meta.get("step", step or 0))
    size = batch_size or recipe.train.batch_size
    tokens = batch_at(
        data.train, step=at, seed=recipe.train.seed, batch_size=size, seq_len=recipe.data.seq_len
    )
    result = {"run": str(run_dir), "step": at}
    result.update(analyze_model(model, jnp.asarray(tokens), micro_batch=micro_batch, iters=iters))
    peak_lr = recipe.optim.lr
    result["peak_lr"] = peak_lr
    out = run_dir / ("analysis.json" if step is None else f"analysis-{at}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    result["written"] = str(out)
    return result


def format_analysis(r: dict[str, Any]) -> list[str]:
    ns = r["noise_scale"]
    lines = [
        f"loss on the batch: {r['loss']:.4f} ({r['batch']} x {r['seq_len']} tokens)",
        f"Hessian top eigenvalue: {r['hessian_top_eigenvalue']:.4g} "
        f"({len(r['hessian_iterations'])} HVP iterations); 2/lambda = "
        f"{r['gd_stable_lr_bound']:.3g} (plain-GD stability bound on the learning rate)",
        f"gradient noise scale B_simple: {ns['b_simple']:.3g} sequences "
        f"= {ns['b_simple_tokens']:.3g} tokens (from {ns['n_micro_batches']} micro-batches of "
        f"{ns['micro_batch']}; |G|^2 = {ns['grad_sq']:.3g}, tr(Sigma) = {ns['trace_sigma']:.3g})",
    ]
    if not np.isfinite(ns["b_simple"]):
        lines.append("  (|G|^2 estimate <= 0: use a larger --batch-size for a usable estimate)")
    return lines
