"""`eqllm eval TARGET`: evaluate a run's checkpoint, or a Hugging Face model on a recipe's data;
with `--tasks`, run lm-evaluation-harness tasks on anything eqllm loads."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from eqllm.data import prepare
from eqllm.data.instruct import ChatFormat
from eqllm.eval.evaluate import evaluate_run, format_eval, heldout_of
from eqllm.hub import from_pretrained
from eqllm.loading import load_run, run_folder_of
from eqllm.recipe import RecipeError, load_recipe
from eqllm.runs import RunFolder, RunFolderError


def eval_command(args: argparse.Namespace) -> int:
    """`eqllm eval RUN_DIR_OR_CHECKPOINT [--step N]`: re-evaluate a run's checkpoint."""
    if args.tasks is not None:
        return _eval_tasks(args)
    run = run_folder_of(args.target)
    if run is None:
        return _eval_pretrained(args)
    run_dir, step = run[0], args.step if args.step is not None else run[1]
    model, tokenizer, recipe, meta = load_run(run_dir, step, args.set or [])
    folder = RunFolder(run_dir)
    heldout = folder.heldout()
    if heldout is None:  # a folder written before it kept its held-out tokens: the data's
        try:
            recipe.check_inputs()
        except RecipeError as e:
            raise RunFolderError(
                f"{run_dir} keeps no held-out tokens (an older run folder), so evaluating it "
                f"reads the run's data, which is missing: {e} (or --set it to where it is now)"
            ) from None
        data = prepare(
            recipe.data.source.to_source(),
            run_dir / RunFolder.TOKENIZER_FILE,
            cache_dir=recipe.data.cache_dir or None,
            val_fraction=recipe.data.val_fraction,
            seed=recipe.data.split_seed,
            progress=True,
        )
        heldout = heldout_of(data, recipe)
    chat = ChatFormat(tokenizer, folder.chat_template()) if folder.prompts_in_chat() else None
    print(f"evaluating {run_dir} at step {meta['step']}", file=sys.stderr)
    result = evaluate_run(model, heldout, recipe, tokenizer, chat=chat, progress=True)
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
    result = evaluate_run(model, heldout_of(data, recipe), recipe, data.tokenizer)
    for line in format_eval(result):
        print(line)
    for text in result.get("samples", []):
        print("-" * 40 + "\n" + text)
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    """Harness tasks: print the metrics table, write the results JSON (and, for a run folder,
    the table into its report.md)."""
    from eqllm import harness  # lm-eval is an optional extra: HarnessError says how to install

    run = run_folder_of(args.target)
    if run is not None:
        run_dir = run[0]
        model, tokenizer, _, meta = load_run(
            run_dir, args.step if args.step is not None else run[1]
        )
        lm = harness.EqllmLM(
            model=model, tokenizer=args.tokenizer or tokenizer, batch_size=args.batch_size
        )
    else:
        lm = harness.EqllmLM(
            args.target, step=args.step, tokenizer=args.tokenizer, batch_size=args.batch_size
        )
    results = harness.evaluate(
        lm,
        args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        include_path=args.include_path,
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
    )
    table = harness.results_table(results)
    print(table)
    if args.output:
        out = Path(args.output)
    elif run is not None:
        out = run_dir / f"harness-{meta['step']}.json"
    else:
        out = Path("harness-results.json")
    harness.write_results(results, out)
    print(f"wrote {out}")
    if run is not None:
        report = write_report_section(run_dir, meta["step"], table)
        print(f"wrote the table into {report}")
    return 0


def write_report_section(run_dir: Path, step: int, table: str) -> Path:
    """Add (or replace) the run's report.md section of harness scores at `step`."""
    heading = f"## lm-evaluation-harness, step {step}"
    report = RunFolder(run_dir).report_file
    text = report.read_text() if report.is_file() else ""
    section = f"{heading}\n\n(`eqllm eval` with `--tasks`)\n\n{table.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + section
    report.write_text(text)
    return report


def _limit(text: str) -> int | float:
    """--limit: a number of documents per task, or a fraction of each task below 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive count (or a fraction < 1)")
    return int(value) if value >= 1 else value


def add_parser(commands) -> None:
    """Register `eqllm eval` on the CLI's subparsers."""
    parser = commands.add_parser("eval", help="evaluate a run folder, checkpoint or model")
    parser.add_argument(
        "target",
        help="a run folder, one of its checkpoints (RUN/checkpoints/STEP), or a Hugging Face "
        "model folder / hub id (with --tasks also an eqllm model folder or a zoo name)",
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument(
        "--recipe",
        default="quickstart",
        help="for a Hugging Face model: the recipe whose data and eval settings to use",
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override")
    harness = parser.add_argument_group(
        'lm-evaluation-harness tasks (needs the extra: pip install "eqllm[eval]")'
    )
    harness.add_argument(
        "--tasks",
        help="comma-separated harness tasks (e.g. lambada_openai,hellaswag); the target may also "
        "be a zoo name (with --tokenizer)",
    )
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples")
    harness.add_argument("--limit", type=_limit, default=None, help="documents per task")
    harness.add_argument("--batch-size", type=int, default=16, help="rows per forward (16)")
    harness.add_argument("--include-path", default=None, help="a folder of extra task YAMLs")
    harness.add_argument(
        "--output",
        default=None,
        help="results JSON (default: RUN/harness-STEP.json, or ./harness-results.json)",
    )
    harness.add_argument("--tokenizer", default=None, help="tokenizer for a model without one")
    harness.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="format requests with the model's chat template (instruct models)",
    )
    harness.add_argument(
        "--fewshot-as-multiturn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="few-shot examples as chat turns or not (default: lm_eval's, turns with a template)",
    )
    parser.set_defaults(func=eval_command)
