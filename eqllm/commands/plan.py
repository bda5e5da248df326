"""`eqllm plan MODEL_OR_RECIPE --topology v5p-128`: a training step compiled for a TPU slice.

Examples:
    eqllm plan llama3-8b                                   # the recipe, on its [plan] slice
    eqllm plan zoo:llama3-8b --topology v5p-128 --mesh fsdp=64 --batch 64 --seq 8192 --remat full
    eqllm plan zoo:mixtral-8x7b --topology v5p-256 --mesh auto --write-recipe mixtral.toml
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

from eqllm.config import RematPolicy
from eqllm.plan.devices import PlanError, attached_slice, require_libtpu, slice_devices
from eqllm.plan.plan import parse_mesh, plan_recipe, recipe_for, with_settings
from eqllm.plan.report import describe, search_summary, search_table
from eqllm.plan.search import search
from eqllm.recipe import RecipeError, load_recipe, parse_value
from eqllm.sharding.tpu import parse_slice


def plan_command(args: argparse.Namespace) -> int:
    require_libtpu()
    recipe, from_zoo = recipe_for(args.model)
    tpu, devices = _slice(args, recipe)
    auto = args.mesh == "auto"
    settings = dict(
        mesh=None if auto or args.mesh is None else parse_mesh(args.mesh),
        batch=args.batch or (tpu.chips if from_zoo else None),
        seq=args.seq,
        remat=args.remat,
        grad_accum=args.grad_accum,
        microbatches=args.microbatches,
        precision=args.precision,
        topology=tpu.cloud_name,
        slices=tpu.slices,
    )
    try:
        recipe = with_settings(recipe, **settings)
        for item in args.set or []:
            key, _, value = item.partition("=")
            recipe = recipe.replace(key.strip(), parse_value(value.strip()))
    except RecipeError as e:
        raise RecipeError(f"{args.model}: {e}") from None
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    if auto:
        found = search(
            recipe,
            tpu,
            devices,
            max_compiles=args.max_compiles,
            time_limit=args.time_limit,
            log=log,
        )
        best = found.best
        if args.json:
            out = {"search": [p.to_dict() for p in found.plans], "best": best and best.to_dict()}
            out["uncompiled"] = [c.to_dict() for c in found.candidates[len(found.plans) :][:10]]
            print(json.dumps(out, indent=2))
        else:
            print(search_table(found))
            print(search_summary(found))
    else:
        log(f"compiling {recipe.name} for {tpu.describe()} ...")
        best = plan_recipe(recipe, tpu, devices)
        print(json.dumps(best.to_dict(), indent=2) if args.json else describe(best))
    if args.dump_hlo and best is not None and best.step.hlo:
        Path(args.dump_hlo).write_text(best.step.hlo)
    if args.write_recipe:
        if best is None or not best.fits:
            raise PlanError(f"--write-recipe {args.write_recipe}: no plan that fits to write")
        path = Path(args.write_recipe)
        path.write_text(best.recipe.to_toml())
        load_recipe(path)  # what `eqllm run` will read back
        print(f"wrote {path} (eqllm run {path})", file=sys.stderr)
    return 0 if best is not None and best.fits else 1  # 1: a finding (it does not fit)


def _slice(args, recipe):
    """The slice to compile for and its devices: --topology, the recipe's [plan], or the TPUs
    attached to this host."""
    name = args.topology or recipe.plan.topology
    if name:
        tpu = parse_slice(name, args.slices or (1 if args.topology else recipe.plan.slices))
        return tpu, slice_devices(tpu)
    attached = attached_slice()
    if attached is None:
        raise PlanError(
            f"{args.model}: name a TPU slice with --topology (e.g. v5p-128); the recipe has no "
            "[plan] topology and no TPU is attached here"
        )
    return attached


def add_parser(commands) -> None:
    """Register `eqllm plan` on the CLI's subparsers."""
    p = commands.add_parser(
        "plan",
        help="compile a run's training step for a TPU slice (no TPU needed): memory, FLOPs, "
        "collectives, a roofline estimate; --mesh auto finds the fastest plan that fits",
    )
    p.add_argument(
        "model",
        help="a recipe (name or .toml), or a zoo model (zoo:NAME; large-scale defaults: bf16 "
        "compute, fp32 AdamW, no remat, fsdp over every chip, one sequence per chip)",
    )
    p.add_argument(
        "--topology",
        help="a Cloud TPU slice (v5p-128 = 64 chips, v5e-256, v5litepod-16, v6e-64, v4-32) or a "
        "JAX topology (v5p:4x4x4); default: the recipe's [plan] topology, else the attached TPUs",
    )
    p.add_argument("--slices", type=int, help="slices joined over the data-center network")
    p.add_argument(
        "--mesh",
        metavar="AXIS=N[,...]|auto",
        help="pipeline=,data=,fsdp=,tensor= sizes (one may be -1), or auto to search",
    )
    p.add_argument("--batch", type=int, help="global batch in sequences (default: the recipe's)")
    p.add_argument("--seq", type=int, help="sequence length (default: the recipe's)")
    p.add_argument("--remat", choices=typing.get_args(RematPolicy))
    p.add_argument("--grad-accum", type=int, help="micro-batches accumulated per step")
    p.add_argument("--microbatches", type=int, help="pipeline microbatches (with pipeline=N)")
    p.add_argument("--precision", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--max-compiles", type=int, default=4, help="--mesh auto: plans compiled")
    p.add_argument(
        "--time-limit",
        type=float,
        default=1800.0,
        help="--mesh auto: start no compile after this many seconds (default 1800)",
    )
    p.add_argument("--write-recipe", metavar="PATH", help="write the recipe of the plan")
    p.add_argument(
        "--dump-hlo", metavar="PATH", help="write the compiled program's HLO text (auto: the best)"
    )
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.set_defaults(func=plan_command)
