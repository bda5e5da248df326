"""Convergence at a fixed compute budget: validation loss against tokens and against FLOPs.

    python benchmarks/convergence.py [--budget 3e13] [--variants gpt2-nano ... llama-mini]

Each variant trains on the built-in corpus (the Python standard library's source, a 4096-token
BPE) for `budget` training FLOPs (FLOPs/token from `ModelConfig.flops_per_token`, so the smaller
models see more tokens), with the real `TrainStep` and `make_optimizer` (AdamW, warmup + cosine),
evaluating the validation loss ~12 times along the way. A power law L(C) = a * C^-alpha is fitted
to the compute frontier (the lowest validation loss reached by any variant at each compute).
The default budget is about an hour of a 2-core CPU; --budget 3e12 takes about a tenth of that.
Writes docs/experiments/convergence.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.bench import machine_info
from eqllm.data import DataSource, batch_at, eval_batches, prepare
from eqllm.model import CausalLM
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, mean_loss, schedule

VARIANTS = ["gpt2-nano", "gpt2-micro", "gpt2-mini", "llama-nano", "llama-micro", "llama-mini"]


@eqx.filter_jit
def _eval_loss(model, batch, mask):
    return mean_loss(model, batch, mask) * mask.sum(), mask.sum()


def val_loss(model, val_sets) -> float:
    total = count = 0.0
    for batch, mask in val_sets:
        s, n = _eval_loss(model, batch, mask)
        total, count = total + float(s), count + float(n)
    return total / count


def train_one(name: str, data, args) -> dict:
    cfg = zoo.config(name, vocab_size=data.tokenizer.vocab_size, max_seq_len=args.seq)
    tokens_per_step = args.batch * args.seq
    flops_per_token = cfg.flops_per_token(args.seq)
    steps = max(int(args.budget / (flops_per_token * tokens_per_step)), 10)
    spec = OptimSpec(lr=args.lr, warmup_steps=max(steps // 10, 1), schedule="cosine")
    model = CausalLM(cfg, key=jax.random.key(args.seed))
    optimizer = make_optimizer(spec, steps, eqx.filter(model, eqx.is_inexact_array))
    step_fn = TrainStep(optimizer, schedule(spec, steps))
    opt_state = init_opt_state(optimizer, model)
    val_sets = [
        (jnp.asarray(b), jnp.asarray(m))
        for b, m in eval_batches(
            data.val, batch_size=args.batch, seq_len=args.seq, max_batches=args.eval_batches
        )
    ]
    eval_at = sorted({max(1, round(steps * k / args.evals)) for k in range(1, args.evals + 1)})
    curve, t0 = [], time.perf_counter()
    for s in range(1, steps + 1):
        batch = batch_at(
            data.train, step=s, seed=args.seed, batch_size=args.batch, seq_len=args.seq
        )
        model, opt_state, metrics = step_fn(model, opt_state, jnp.asarray(batch))
        if s in eval_at:
            loss = val_loss(model, val_sets)
            curve.append(
                {
                    "step": s,
                    "tokens": s * tokens_per_step,
                    "flops": s * tokens_per_step * flops_per_token,
                    "train_loss": float(metrics["loss"]),
                    "val_loss": loss,
                }
            )
            print(f"{name} step {s}/{steps} val {loss:.4f}", file=sys.stderr)
    return {
        "variant": name,
        "params": zoo.param_count(cfg),
        "flops_per_token": flops_per_token,
        "steps": steps,
        "lr": args.lr,
        "seconds": time.perf_counter() - t0,
        "curve": curve,
    }


def fit_frontier(runs: list[dict]) -> dict:
    """Fit log L = log a - alpha log C to the lowest loss reached at each compute (C > 10%)."""
    points = sorted((p["flops"], p["val_loss"]) for r in runs for p in r["curve"])
    frontier, best = [], math.inf
    for c, loss in points:
        if loss < best:
            best = loss
            frontier.append((c, loss))
    cmax = max(c for c, _ in points)
    fit_pts = [(c, loss) for c, loss in frontier if c >= 0.1 * cmax]
    if len(fit_pts) < 2:
        return {"frontier": frontier, "a": None, "alpha": None}
    x = np.log([c for c, _ in fit_pts])
    y = np.log([loss for _, loss in fit_pts])
    slope, intercept = np.polyfit(x, y, 1)
    return {"frontier": frontier, "a": float(math.exp(intercept)), "alpha": float(-slope)}


def write_page(result: dict, out: Path, command: str, reduced: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, fit = result["runs"], result["fit"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        style = "-" if r["variant"].startswith("llama") else "--"
        xs = [p["tokens"] for p in r["curve"]]
        axes[0].plot(xs, [p["val_loss"] for p in r["curve"]], "o" + style, ms=3, label=r["variant"])
        xs = [p["flops"] for p in r["curve"]]
        axes[1].plot(xs, [p["val_loss"] for p in r["curve"]], "o" + style, ms=3, label=r["variant"])
    if fit["alpha"] is not None:
        cs = np.geomspace(min(c for c, _ in fit["frontier"]), max(c for c, _ in fit["frontier"]))
        axes[1].plot(cs, fit["a"] * cs ** -fit["alpha"], "k:", label=f"fit C^-{fit['alpha']:.3f}")
    axes[0].set(xlabel="training tokens", ylabel="validation loss (nats/token)", xscale="log")
    axes[1].set(xlabel="training FLOPs", ylabel="validation loss (nats/token)", xscale="log")
    for ax in axes:
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=110)
    plt.close(fig)
    lines = [
        "# Convergence at a fixed compute budget" + (" (REDUCED run)" if reduced else ""),
        "",
        f"Regenerate: `{command}`",
        "",
        *[f"- {k}: {v}" for k, v in machine_info().items()],
        f"- budget: {result['budget']:.2g} training FLOPs per variant; batch x seq "
        f"{result['batch']} x {result['seq']}; AdamW lr {result['lr']}, 10% warmup, cosine; "
        f"data: Python stdlib source, BPE {result['vocab']} tokens",
        "",
    ]
    if reduced:
        lines += [
            f"This is a reduced run ({result['budget']:.2g} FLOPs per variant). The full study "
            "is `python benchmarks/convergence.py --budget 3e13` (about an hour of a 2-core "
            "CPU).",
            "",
        ]
    lines += [
        "| variant | params | FLOPs/token | steps | tokens | final val loss | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        last = r["curve"][-1]
        lines.append(
            f"| {r['variant']} | {r['params'] / 1e6:.2f}M | {r['flops_per_token'] / 1e6:.1f}M | "
            f"{r['steps']} | {last['tokens']:,} | {last['val_loss']:.3f} | {r['seconds']:.0f} |"
        )
    if fit["alpha"] is not None:
        lines += [
            "",
            f"Fitted compute frontier: L(C) = {fit['a']:.3g} * C^-{fit['alpha']:.3f} "
            f"(least squares in log-log on the frontier points above 10% of the budget).",
        ]
    lines += [
        "",
        "Caveats: tiny models and budgets far from the regime where scaling laws were measured; "
        "one seed; one learning rate for every size (not tuned per size); intermediate points "
        "of a cosine schedule are not compute-optimal runs of their own length, so the curves "
        "are not the frontier a sweep over budgets would give; the pure power law has no "
        "irreducible-loss term, which a longer range of compute would need; the validation "
        "set is a small slice of the same corpus.",
        "",
        "![validation loss](convergence.png)",
        "",
    ]
    (out / "convergence.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--budget", type=float, default=3e13, help="training FLOPs per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--evals", type=int, default=12)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=16 << 20, help="corpus size cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/experiments")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare(DataSource.stdlib(max_bytes=args.max_bytes), "bpe", bpe_vocab_size=4096)
    runs = [train_one(v, data, args) for v in args.variants]
    result = {
        "budget": args.budget,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "vocab": data.tokenizer.vocab_size,
        "runs": runs,
        "fit": fit_frontier(runs),
    }
    (out / "convergence.json").write_text(json.dumps(result, indent=2) + "\n")
    command = "python benchmarks/convergence.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_page(result, out, command, reduced=args.budget < 3e13)
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
