"""`eqllm bench [VARIANTS]`: compile time, step time, tokens/s, MFU and memory per variant.

Example:
    eqllm bench gpt2-mini llama-mini --batch 16 --seq 256 --steps 10 --vs-torch --out bench/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path

from eqllm.bench import (
    FLOPS_CONVENTION,
    MESH_NOTE,
    format_table,
    machine_info,
    mesh_markdown,
    parse_overrides,
    run_bench,
    run_mesh_bench,
    write_report,
)
from eqllm.config import RematPolicy
from eqllm.errors import EqllmError
from eqllm.recipe import OptimSpec
from eqllm.recipe.optim import OptimizerName


def command_line(args, variants: Sequence[str]) -> str:
    """The `eqllm bench ...` command that regenerates a report, from the parsed arguments."""
    parts = ["eqllm bench", *variants, f"--batch {args.batch} --seq {args.seq}"]
    if not args.mesh:  # a mesh report compiles the step and times nothing
        parts.append(f"--steps {args.steps} --warmup {args.warmup}")
    parts.append(f"--dtype {args.dtype}")
    if args.remat != "none":
        parts.append(f"--remat {args.remat}")
    parts += [f"--mesh {m}" for m in args.mesh or []]
    if args.mesh and args.optimizer != "adamw":
        parts.append(f"--optimizer {args.optimizer}")
    if args.vs_torch:
        parts.append("--vs-torch" + (" --no-compile" if args.no_compile else ""))
    parts += [f"--set {s}" for s in args.set or []]
    if getattr(args, "document_length", 0):
        parts.append(f"--document-length {args.document_length}")
    if args.out:
        parts.append(f"--out {args.out}")
    return " ".join(parts)


def bench_command(args: argparse.Namespace) -> int:
    """`eqllm bench`: time each variant, print the table, write the report with --out."""
    variants = args.variants or ["gpt2-mini", "llama-mini"]
    if args.vs_torch:
        # JAX would otherwise reserve most of a GPU's memory before torch allocates any; this
        # only takes effect if no JAX backend has started yet, as is the case from the CLI.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.optimizer != "adamw" and not args.mesh:
        raise EqllmError(
            f"--optimizer {args.optimizer}: only the --mesh report compiles another optimizer; "
            "add --mesh (e.g. --mesh fsdp=8) or drop --optimizer"
        )
    t0 = time.perf_counter()
    if args.mesh:
        return mesh_command(args, variants, t0)
    results = run_bench(
        variants,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        dtype=args.dtype,
        remat=args.remat,
        vs_torch=args.vs_torch,
        torch_compile=not args.no_compile,
        overrides=parse_overrides(args.set or []),
        document_length=args.document_length or None,
        log=(lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr)),
    )
    meta = {
        "command": command_line(args, variants),
        **machine_info(),
        "batch x seq": f"{args.batch} x {args.seq}",
        "timed steps": args.steps,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall time": f"{time.perf_counter() - t0:.0f}s",
    }
    print(format_table(results))
    print(FLOPS_CONVENTION)
    if args.out:
        paths = write_report(results, args.out, meta, plots=not args.no_plots)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def mesh_command(args: argparse.Namespace, variants: Sequence[str], t0: float) -> int:
    """`eqllm bench --mesh M [--mesh M2 ...]`: compile on each mesh, report memory/collectives."""
    results = run_mesh_bench(
        variants,
        args.mesh,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        remat=args.remat,
        overrides=parse_overrides(args.set or []),
        optim=OptimSpec(name=args.optimizer),
        log=(lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr)),
    )
    table = mesh_markdown(results)
    print(table)
    print(MESH_NOTE)
    if args.out:
        meta = {
            "command": command_line(args, variants),
            **machine_info(),
            "batch x seq": f"{args.batch} x {args.seq}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "wall time": f"{time.perf_counter() - t0:.0f}s",
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = [r.to_dict() for r in results]
        (out / "bench.json").write_text(json.dumps({"meta": meta, "mesh": rows}, indent=2) + "\n")
        head = [f"Command: `{meta['command']}`", ""]
        head += [f"- {k}: {v}" for k, v in meta.items() if k != "command"]
        (out / "bench.md").write_text(
            "\n".join(["# eqllm bench --mesh", "", *head, "", table, "", MESH_NOTE, ""])
        )
        print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}")
    return 0


def add_parser(commands) -> None:
    """Register `eqllm bench` on the CLI's subparsers."""
    p = commands.add_parser(
        "bench",
        help="time the training step (compile, step, tokens/s, MFU, memory), optionally vs PyTorch",
    )
    p.add_argument("variants", nargs="*", help="zoo names (default: gpt2-mini llama-mini)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--remat", choices=typing.get_args(RematPolicy), default="none")
    p.add_argument("--vs-torch", action="store_true", help="also time transformers (eager+compile)")
    p.add_argument("--no-compile", action="store_true", help="with --vs-torch: skip torch.compile")
    p.add_argument(
        "--mesh",
        action="append",
        metavar="AXIS=N[,...]",
        help="compile the step on this mesh (repeatable; e.g. data=8, fsdp=8) and report its "
        "per-device memory and collectives instead of timing it",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE[,...]", help="config overrides")
    p.add_argument(
        "--optimizer",
        choices=typing.get_args(OptimizerName),
        default="adamw",
        help="with --mesh: the optimizer of the compiled step (OptimSpec's other defaults)",
    )
    p.add_argument(
        "--document-length",
        type=int,
        default=0,
        help="pack documents of this many tokens, masked from each other (0: no masking)",
    )
    p.add_argument("--out", help="folder for bench.md, bench.json, bench.png")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no per-step progress on stderr")
    p.set_defaults(func=bench_command)
