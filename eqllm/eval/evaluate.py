"""The end-of-run evaluation (validation, baseline, extra sources, samples) and `eqllm eval`."""

from __future__ import annotations

import argparse
import json
import sys

import jax

from eqllm.data import TokenData, Tokenizer, prepare
from eqllm.eval.harness import evaluate_tokens, loss_report, unigram_loss
from eqllm.generation import generate_batch
from eqllm.model import CausalLM
from eqllm.recipe import Recipe


def eval_batch_size(recipe: Recipe) -> int:
    return recipe.eval.batch_size or recipe.train.batch_size


def evaluate_run(
    model: CausalLM,
    data: TokenData,
    recipe: Recipe,
    *,
    samples: bool = True,
    progress: bool = False,
) -> dict:
    """Validation loss/perplexity/bpb, the unigram baseline, extra sources and samples.

    Returns a JSON-ready dict: ``val`` (loss, perplexity, bpb, tokens), ``unigram`` (loss, bpb),
    ``extra`` (per source label), ``samples`` (list of texts).
    """
    seq_len, bs = recipe.data.seq_len, eval_batch_size(recipe)
    max_batches = recipe.eval.batches or None
    result: dict = {}
    if data.val.shape[0] > seq_len:
        loss, n = evaluate_tokens(
            model, data.val, batch_size=bs, seq_len=seq_len, max_batches=max_batches
        )
        bpt = data.bytes_per_token("val")
        result["val"] = {**loss_report(loss, bpt), "tokens": n}
        uni = unigram_loss(data.train, data.val, data.tokenizer.vocab_size)
        result["unigram"] = loss_report(uni, bpt)
    for i, spec in enumerate(recipe.eval.extra_sources):
        label = spec.label or spec.path or spec.name or f"extra{i}"
        extra = prepare(
            spec.to_source(),
            data.tokenizer,
            cache_dir=recipe.data.cache_dir or None,
            val_fraction=0.0,
            progress=progress,
        )
        loss, n = evaluate_tokens(
            model, extra.train, batch_size=bs, seq_len=seq_len, max_batches=max_batches
        )
        result.setdefault("extra", {})[label] = {
            **loss_report(loss, extra.bytes_per_token("train")),
            "tokens": n,
        }
    if samples and recipe.eval.sample_prompts and recipe.eval.sample_tokens:
        result["samples"] = sample_texts(
            model,
            data.tokenizer,
            list(recipe.eval.sample_prompts),
            max_new_tokens=recipe.eval.sample_tokens,
            key=jax.random.key(recipe.train.seed),
            temperature=recipe.eval.temperature,
            top_k=recipe.eval.top_k or None,
        )
    return result


def sample_texts(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    key,
    temperature: float,
    top_k: int | None,
) -> list[str]:
    """Prompt + continuation texts from `eqllm.generate_batch`, stopping at end-of-text.

    Continuations are cut to fit the context after the longest prompt.
    """
    encoded = [tokenizer.encode(p) or [tokenizer.eot_id] for p in prompts]
    room = model.config.max_seq_len - max(len(ids) for ids in encoded)
    if room < 1:
        raise ValueError(
            f"a sample prompt fills the model's context of {model.config.max_seq_len} tokens; "
            "shorten eval.sample_prompts"
        )
    outputs = generate_batch(
        model,
        encoded,
        max_new_tokens=min(max_new_tokens, room),
        key=key,
        temperature=temperature,
        top_k=top_k,
        stop_tokens=(tokenizer.eot_id,),
    )
    texts = []
    for prompt, new in zip(prompts, outputs, strict=True):
        ids = [int(t) for t in new if t != tokenizer.eot_id]
        texts.append(prompt + tokenizer.decode(ids))
    return texts


def format_eval(result: dict) -> list[str]:
    lines = []
    if "val" in result:
        v, u = result["val"], result["unigram"]
        lines.append(
            f"validation: loss {v['loss']:.4f}  perplexity {v['perplexity']:.2f}  "
            f"bits/byte {v['bpb']:.4f}  (unigram baseline {u['bpb']:.4f} bits/byte)"
        )
    for label, r in result.get("extra", {}).items():
        lines.append(
            f"{label}: loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}  "
            f"bits/byte {r['bpb']:.4f}"
        )
    return lines


def eval_command(args: argparse.Namespace) -> int:
    """`eqllm eval RUN_DIR_OR_CHECKPOINT [--step N]`: re-evaluate a run's checkpoint."""
    from eqllm.loading import load_run, run_folder_of

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
    from eqllm import hub
    from eqllm.recipe import load_recipe

    model = hub.from_pretrained(args.target)
    recipe = load_recipe(args.recipe, [f'data.tokenizer="{args.target}"', *(args.set or [])])
    data = prepare(
        recipe.data.source.to_source(),
        recipe.data.tokenizer,
        cache_dir=recipe.data.cache_dir or None,
        val_fraction=recipe.data.val_fraction,
        seed=recipe.data.split_seed,
    )
    if data.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {data.tokenizer.vocab_size} ids, the model only "
            f"{model.config.vocab_size}"
        )
    result = evaluate_run(model, data, recipe)
    for line in format_eval(result):
        print(line)
    for text in result.get("samples", []):
        print("-" * 40 + "\n" + text)
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
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
