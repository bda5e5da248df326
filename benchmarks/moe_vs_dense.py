"""A mixture of experts against dense models of the same active and of the same total size.

    python benchmarks/moe_vs_dense.py [--variant mixtral-nano --batch 16 --seq 256 --steps 5]
        [--converge-steps 200 --converge-batch 8 --converge-seq 128]

Three models with the MoE variant's vocabulary, width, depth and attention: the MoE itself
(from the zoo), and two Llama-layout dense models whose SwiGLU `d_ff` is solved so that their
parameter count matches the MoE's ACTIVE count (parameters one token uses) and its TOTAL count.
The MoE is timed with each `moe_impl` ("dense": every expert on every token; "ragged": grouped
`jax.lax.ragged_dot`). Each model runs the real training step (`TrainStep` + `make_optimizer`:
forward, backward, AdamW, metrics, one compiled call, through `eqllm.bench.JaxBench`) on the
same random batch; the models take turns step by step so machine noise hits all alike, and the
figure is the median step after one warm-up step (compile time left out). Memory is XLA's
compiled memory analysis of that step: arguments (model, optimizer state, batch), temporaries,
and the total (arguments + outputs + temporaries - donated aliases).

With `--converge-steps N` (0 skips it), the three models (the MoE with its default `moe_impl`)
also train N steps on the built-in corpus (4 MB of the Python standard library, 4096-token BPE)
with the same optimizer, batches and seed; the table gives the validation loss (cross-entropy
only, without the MoE's load-balancing term) at a few points along the way.
"""

from __future__ import annotations

import argparse
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, bench_config, random_tokens
from eqllm.config import ModelConfig
from eqllm.data import DataSource, batch_at, eval_batches, prepare
from eqllm.model import CausalLM
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, mean_loss, schedule

MB = 1 << 20


def dense_like(moe: ModelConfig, target: int) -> ModelConfig:
    """The Llama-layout dense model with `moe`'s shape whose parameter count is nearest `target`.

    The count is linear in d_ff (3 * d_model * n_layers per unit of d_ff), so d_ff is solved
    exactly and rounded to the nearest integer.
    """
    base = zoo.config(
        "llama-nano",
        vocab_size=moe.vocab_size,
        d_model=moe.d_model,
        n_layers=moe.n_layers,
        attention={
            "n_heads": moe.attention.n_heads,
            "n_kv_heads": moe.attention.n_kv_heads,
            "head_dim": moe.head_dim,
        },
        positions={"theta": moe.positions.theta},
        max_seq_len=moe.max_seq_len,
        tie_embeddings=moe.tie_embeddings,
        scan_layers=moe.scan_layers,
        mlp={"d_ff": 1},
    )
    per_unit = 3 * base.d_model * base.n_layers
    d_ff = max(1, round((target - zoo.param_count(base)) / per_unit) + 1)
    return base.replace(mlp={"d_ff": d_ff})


def _memory(bench: JaxBench) -> dict:
    m = bench.compiled.compiled.memory_analysis()
    return {
        "args_mb": m.argument_size_in_bytes / MB,
        "temp_mb": m.temp_size_in_bytes / MB,
        "total_mb": bench.memory_bytes / MB,
    }


def speed_table(models: dict[str, ModelConfig], args) -> list[dict]:
    tokens = random_tokens(models["moe"].vocab_size, args.batch, args.seq)
    runs = {}
    for name, cfg in models.items():
        cfg = bench_config(cfg, args.seq)
        impls = ("dense", "ragged") if cfg.moe is not None else (None,)
        for impl in impls:
            label = f"{name} ({impl})" if impl else name
            c = cfg.replace(moe={"impl": impl}) if impl else cfg
            runs[label] = JaxBench(c, tokens)
            runs[label].compile()
            runs[label].step()  # warm-up
            print(f"compiled {label}", file=sys.stderr)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(args.steps):
        for label, b in runs.items():
            times[label].append(b.step())
    rows = []
    for label, b in runs.items():
        med = float(np.median(times[label]))
        rows.append(
            {
                "model": label,
                "d_ff": b.config.mlp.d_ff,
                "params": b.params,
                "active": zoo.active_param_count(b.config),
                "flops_per_token": b.config.flops_per_token(args.seq),
                "xla_gflop": (b.xla_flops or float("nan")) / 1e9,
                "ms": med * 1e3,
                "tokens_s": args.batch * args.seq / med,
                **_memory(b),
            }
        )
    return rows


def converge(models: dict[str, ModelConfig], args) -> dict[str, list[tuple[int, float]]]:
    data = prepare(DataSource.stdlib(max_bytes=4_000_000), "bpe", bpe_vocab_size=4096)
    bs, seq, steps = args.converge_batch, args.converge_seq, args.converge_steps
    val = [
        (jnp.asarray(b), jnp.asarray(m))
        for b, m in eval_batches(data.val, batch_size=bs, seq_len=seq, max_batches=8)
    ]
    loss_fn = eqx.filter_jit(lambda m, b, k: mean_loss(m, b, k) * k.sum())
    spec = OptimSpec(lr=args.lr, warmup_steps=max(steps // 10, 1), schedule="cosine")
    eval_at = sorted({max(1, round(steps * k / 4)) for k in range(1, 5)})
    curves = {}
    for name, cfg in models.items():
        cfg = cfg.replace(vocab_size=data.tokenizer.vocab_size, max_seq_len=seq)
        model = CausalLM(cfg, key=jax.random.key(args.seed))
        optimizer = make_optimizer(spec, steps, eqx.filter(model, eqx.is_inexact_array))
        step_fn = TrainStep(optimizer, schedule(spec, steps))
        opt_state = init_opt_state(optimizer, model)
        curve, t0 = [], time.perf_counter()
        for s in range(1, steps + 1):
            batch = batch_at(data.train, step=s, seed=args.seed, batch_size=bs, seq_len=seq)
            model, opt_state, _ = step_fn(model, opt_state, jnp.asarray(batch))
            if s in eval_at:
                total = sum(float(loss_fn(model, b, k)) for b, k in val)
                curve.append((s, total / sum(float(k.sum()) for _, k in val)))
        print(f"{name}: {curve} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        curves[name] = curve
    return curves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="mixtral-nano")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model")
    parser.add_argument("--converge-steps", type=int, default=0)
    parser.add_argument("--converge-batch", type=int, default=8)
    parser.add_argument("--converge-seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    moe = zoo.config(args.variant)
    if moe.moe is None:
        parser.error(f"--variant {args.variant} is not a mixture of experts")
    models = {
        "moe": moe,
        "dense, same active": dense_like(moe, zoo.active_param_count(moe)),
        "dense, same total": dense_like(moe, zoo.param_count(moe)),
    }
    print(f"{args.variant} against dense Llama-layout models, {jax.devices()[0].device_kind}, fp32")
    print(
        f"\nTraining step, batch {args.batch} x {args.seq}, median of {args.steps} steps:\n\n"
        "| model | d_ff | params | active params | FLOPs/token | XLA GFLOP/step | ms/step "
        "| tokens/s | arguments MB | temporaries MB | total MB |\n" + "|---" * 11 + "|"
    )
    rows = speed_table(models, args)
    for r in rows:
        print(
            f"| {r['model']} | {r['d_ff']} | {r['params']:,} | {r['active']:,} "
            f"| {r['flops_per_token'] / 1e6:.1f}M | {r['xla_gflop']:.0f} | {r['ms']:.0f} "
            f"| {r['tokens_s']:,.0f} "
            f"| {r['args_mb']:.1f} | {r['temp_mb']:.1f} | {r['total_mb']:.1f} |"
        )
    moe_row = rows[0]
    print()
    for r in rows[2:]:
        target = moe_row["active"] if "active" in r["model"] else moe_row["params"]
        print(f"{r['model']}: {r['params'] / target - 1:+.2%} parameters against the MoE's")
    if args.converge_steps:
        curves = converge(models, args)
        points = [s for s, _ in next(iter(curves.values()))]
        print(
            f"\nValidation loss, {args.converge_steps} steps of batch {args.converge_batch} x "
            f"{args.converge_seq}, lr {args.lr}:\n\n| model | "
            + " | ".join(f"step {s}" for s in points)
            + " |\n|---|"
            + "---|" * len(points)
        )
        for name, curve in curves.items():
            print(f"| {name} | " + " | ".join(f"{v:.3f}" for _, v in curve) + " |")
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
