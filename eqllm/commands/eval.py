"""`eqllm eval TARGET`: evaluate a run's checkpoint, or a Hugging Face model on a recipe's data."""

from __future__ import annotations

import argparse
import json
import sys

from eqllm.data import prepare
from eqllm.eval.evaluate import evaluate_run, format_eval
from eqllm.hub import from_pretrained
from eqllm.loading import load_run, run_folder_of
from eqllm.recipe import RecipeError, load_recipe


def eval_command(args: argparse.Namespace) -> int:
    """`eqllm eval RUN_DIR_OR_CHECKPOINT [--step N]`: re-evaluate a run's checkpoint."""
    run = run_folder_of(args.target)
    if run is None:
        return _eval_pretrained(args)
    run_dir, step = run[0], args.step if args.step is not None else run[1]
    model, tokenizer, recipe, meta = load_run(run_dir, step, args.set or [])
    data = prepare(
        recipe.data.source.to_source(),
        run_dir / "tokenizer.json",
        cache_dir=recipe.data.cache_dir or None,
        val_fraction=recipe.data.val_fraction,
        seed=recipe.data.split_seed,
        progress=True,
    )
    print(f"evaluating {run_dir} at step {meta['step']}", file=sys.stderr)
    result = evaluate_run(model, data, recipe, progress=True)
    result["step"] = meta["step"]
    for line in format_eval(result):
        print(line)
    for text in result.get("samples", []):
        print("-" * 40 + "\n" + text)
    out = run_dir / f"eval-{meta['step']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _eval_pretrained(args: argparse.Namespace) -> int:
    """Evaluate a Hugging Face-format model (folder or hub id) on a recipe's validation split."""
    model = from_pretrained(args.target)
    recipe = load_recipe(args.recipe, [f'data.tokenizer="{args.target}"', *(args.set or [])])
    data = prepare(
        recipe.data.source.to_source(),
        recipe.data.tokenizer,
        cache_dir=recipe.data.cache_dir or None,
        val_fraction=recipe.data.val_fraction,
        seed=recipe.data.split_seed,
    )
    if data.tokenizer.vocab_size > model.config.vocab_size:
        raise RecipeError(
            f"the tokenizer has {data.tokenizer.vocab_size} ids, the model only "
            f"{model.config.vocab_size}; evaluate with the model's own tokenizer "
            f"(data.tokenizer={args.target!r})"
        )
    result = evaluate_run(model, data, recipe)
    for line in format_eval(result):
        print(line)
    for text in result.get("samples", []):
        print("-" * 40 + "\n" + text)
    return 0


def add_parser(commands) -> None:
    """Register `eqllm eval` on the CLI's subparsers."""
    parser = commands.add_parser("eval", help="evaluate a run folder, checkpoint or model")
    parser.add_argument(
        "target",
        help="a run folder, one of its checkpoints (RUN/checkpoints/STEP), or a Hugging Face "
        "model folder / hub id",
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument(
        "--recipe",
        default="quickstart",
        help="for a Hugging Face model: the recipe whose data and eval settings to use",
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override")
    parser.set_defaults(func=eval_command)
