"""`eqllm coordcheck VARIANT --parametrization sp|mup|completep --widths 64,128,256,512
[--depths 2,4,8,16] [--steps 5] [--seeds 3] [--init-std S] [--zero-readout] [--json]`: the
coordinate check of a parametrization.

Writes coord_check.png (in --out, default the working directory) and prints the slope of
log2 mean |activation| against log2 width (or depth) per layer and step; `--json` prints
`{"slopes": {name: [slope at each step]}, ...}`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eqllm.bench.coordcheck import coord_check, plot_coord_check
from eqllm.errors import EqllmError


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
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{args.variant}, {args.parametrization}, lr {args.lr:g}"
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
    p.add_argument(
        "--widths", default="64,128,256,512", help="d_model values; the first is the base"
    )
    p.add_argument("--depths", default=None, help="n_layers values (at the first width) instead")
    p.add_argument("--steps", type=int, default=5, help="Adam steps per size")
    p.add_argument("--lr", type=float, default=1e-2, help="the (base) learning rate")
    p.add_argument("--batch", type=int, default=2, help="sequences in the fixed batch")
    p.add_argument("--seq-len", type=int, default=8, help="tokens per sequence")
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per size")
    p.add_argument("--init-std", type=float, default=None, help="init std instead of the variant's")
    p.add_argument(
        "--zero-readout", action="store_true", help="start the LM head at zero (untied head)"
    )
    p.add_argument("--out", default=".", help="folder for coord_check.png")
    p.add_argument("--json", action="store_true", help="print the slopes as JSON")
    p.set_defaults(func=coordcheck_command)
