"""Write the sweep file of an IsoFLOP scaling study: at each compute budget, a few widths around
the optimum, each trained for the steps that spend that budget (a schedule of its own length),
all with one muP learning rate tuned at the base width.

    python benchmarks/scaling_sweep.py --lr 0.0078125 > recipes/sweeps/scaling.toml
    eqllm sweep recipes/sweeps/scaling.toml --out runs/scaling
    eqllm fit runs/scaling/results.jsonl --holdout-largest

The model is the quickstart recipe's llama-nano at 2 layers and 4 heads, d_ff = 4 x d_model,
muP with base_d_model 64 (the width the learning rate was tuned at: the muTransfer study of
docs/scaling-laws.md). A point's steps are budget / (FLOPs per token x tokens per step), with
FLOPs per token from `ModelConfig.flops_per_token` at the run's vocabulary and sequence length,
the same count results.jsonl's `flops` uses.
"""

from __future__ import annotations

import argparse

from eqllm import zoo

VOCAB = 1024  # the quickstart recipe's BPE
SEQ = 128
LAYERS = 2
HEADS = 4


def model_config(width: int):
    return zoo.config(
        "llama-nano",
        d_model=width,
        n_layers=LAYERS,
        max_seq_len=SEQ,
        vocab_size=VOCAB,
        **{"mlp.d_ff": 4 * width, "attention.n_heads": HEADS, "attention.n_kv_heads": HEADS},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, required=True, help="muP learning rate at base width")
    parser.add_argument("--base", type=int, default=64, help="base_d_model (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--warmup", type=int, default=20, help="warmup steps (default 20)")
    parser.add_argument("--max-bytes", type=int, default=31_000_000, help="stdlib bytes")
    parser.add_argument(
        "--budget",
        action="append",
        metavar="FLOPS:W1,W2,...",
        help="a compute budget and its widths (repeatable; default: three budgets 5e11-2e12)",
    )
    args = parser.parse_args()
    budgets = args.budget or [
        "5e11:16,24,32,48,64",
        "1e12:24,32,48,64,96",
        "2e12:32,48,64,96,128",
    ]
    tokens_per_step = args.batch * SEQ
    print("# An IsoFLOP scaling study (docs/scaling-laws.md), written by")
    flags = "".join(f" --budget {b}" for b in args.budget or [])
    print(f"#   python benchmarks/scaling_sweep.py --lr {args.lr!r}{flags}")
    print('recipe = "quickstart"\n\n[set]')
    fixed = {
        "model.overrides.n_layers": LAYERS,
        "model.overrides.attention.n_heads": HEADS,
        "model.overrides.attention.n_kv_heads": HEADS,
        "model.overrides.parametrization": '"mup"',
        "model.overrides.base_d_model": args.base,
        "optim.lr": repr(args.lr),
        "optim.warmup_steps": args.warmup,
        "train.batch_size": args.batch,
        "train.eval_every": 0,
        "train.checkpoint_every": 500,
        "eval.sample_tokens": 0,
        "data.source.max_bytes": args.max_bytes,
    }
    for key, value in fixed.items():
        print(f'"{key}" = {value}')
    for spec in budgets:
        flops, _, widths = spec.partition(":")
        budget = float(flops)
        for width in (int(w) for w in widths.split(",")):
            per_token = model_config(width).flops_per_token(SEQ)
            steps = round(budget / (per_token * tokens_per_step))
            print(f"\n[[points]]  # budget {budget:.0e} FLOPs, {steps * tokens_per_step:,} tokens")
            print(f'"model.overrides.d_model" = {width}')
            print(f'"model.overrides.mlp.d_ff" = {4 * width}')
            print(f'"train.steps" = {steps}')


if __name__ == "__main__":
    main()
