"""`eqllm coordcheck VARIANT --parametrization sp|mup|completep --widths 64,128,256
[--depths 2,4,8,16] [--optimizer adamw|muon|lion|adafactor] [--steps 3] [--lr LR] [--seeds 3]
[--init-std S] [--[no-]zero-readout] [--json]`: the coordinate check of a parametrization.

Writes coord_check.png (in --out, default the working directory) and prints the slope of
log2 mean |activation| against log2 width (or depth) per layer and step; `--json` prints
`{"slopes": {name: [slope at each step]}, ...}`.
"""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

from eqllm.bench.coordcheck import CHECK_LR, coord_check, plot_coord_check
from eqllm.errors import EqllmError
from eqllm.recipe.optim import OptimizerName


def _sizes(text: str, flag: str, least: int = 2) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) < least or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        what = "two or more distinct positive integers" if least > 1 else "positive integers"
        raise EqllmError(f"{flag} {text!r} must be {what}, e.g. 64,128")
    return sizes


def coordcheck_command(args: argparse.Namespace) -> int:
    depths = _sizes(args.depths, "--depths") if args.depths else None
    # Over depth the width is fixed: the first of --widths (one is enough).
    widths = _sizes(args.widths, "--widths", least=1 if depths else 2)
    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--seeds", args.seeds)):
        if value < 1:
            raise EqllmError(f"{flag} {value} must be at least 1")
    if args.lr is not None and args.lr <= 0:
        raise EqllmError(f"--lr {args.lr} must be positive, e.g. 1e-2")
    if args.init_std is not None and args.init_std <= 0:
        raise EqllmError(f"--init-std {args.init_std} must be positive, e.g. 0.1")
    result = coord_check(
        args.variant,
        args.parametrization,
        widths=widths,
        depths=depths,
        steps=args.steps,
        lr=args.lr,
        batch=args.batch,
        seq_len=args.seq_len,
        seeds=args.seeds,
        init_std=args.init_std,
        zero_readout=args.zero_readout,
        optimizer=args.optimizer,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lr = CHECK_LR[args.optimizer] if args.lr is None else args.lr
    title = f"{args.variant}, {args.parametrization}, {args.optimizer} lr {lr:g}"
    path = plot_coord_check(result, out / "coord_check.png", title)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"slope of log2 mean|activation| against log2 {result.axis}, per step:")
    for name, slopes in result.slopes.items():
        print(f"  {name:10s} " + " ".join(f"{s:+.2f}" for s in slopes))
    print(f"wrote {path}")
    return 0


def add_parser(commands) -> None:
    """Register `eqllm coordcheck` on the CLI's subparsers."""
    p = commands.add_parser("coordcheck", help="coordinate check of a parametrization")
    p.add_argument("variant", help="a zoo name; its width, d_ff (in proportion) and depth change")
    p.add_argument("--parametrization", choices=["sp", "mup", "completep"], default="mup")
    p.add_argument("--widths", default="64,128,256", help="d_model values; the first is the base")
    p.add_argument("--depths", default=None, help="n_layers values (at the first width) instead")
    p.add_argument(
        "--optimizer",
        choices=list(typing.get_args(OptimizerName)),
        default="adamw",
        help="the optimizer, with its muP learning-rate factors (OptimSpec's other defaults)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per size")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="the (base) learning rate (default: 1e-2; 0.1 for Adafactor's relative step)",
    )
    p.add_argument("--batch", type=int, default=2, help="sequences in the fixed batch")
    p.add_argument("--seq-len", type=int, default=8, help="tokens per sequence")
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per size")
    p.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="init std instead of the variant's (default: 1/sqrt(first width), the fan-in init)",
    )
    p.add_argument(
        "--zero-readout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start the LM head at zero (default: when the head is untied)",
    )
    p.add_argument("--out", default=".", help="folder for coord_check.png")
    p.add_argument("--json", action="store_true", help="print the slopes as JSON")
    p.set_defaults(func=coordcheck_command)
