"""The end-of-run evaluation: validation, the unigram baseline, extra sources and samples."""

from __future__ import annotations

import jax

from eqllm.data import MixtureData, TokenData, Tokenizer, prepare
from eqllm.data.instruct import InstructionData
from eqllm.data.prompts import PromptData
from eqllm.eval.metrics import evaluate_tokens, loss_report, unigram_loss
from eqllm.generation import generate_batch
from eqllm.model import CausalLM
from eqllm.recipe import Recipe, RecipeError


def eval_batch_size(recipe: Recipe) -> int:
    return recipe.eval.batch_size or recipe.train.batch_size


def evaluate_run(
    model: CausalLM,
    data: TokenData | InstructionData | PromptData,
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
    if isinstance(data, MixtureData):  # each source of a mixture on its own validation split
        for label, loss, n, bpt in source_losses(model, data, recipe):
            result.setdefault("sources", {})[label] = {**loss_report(loss, bpt), "tokens": n}
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
        result["samples"] = recipe_samples(model, data, recipe)
    return result


def recipe_samples(
    model: CausalLM, data: TokenData | InstructionData | PromptData, recipe: Recipe
) -> list:
    """Samples for the recipe's eval.sample_prompts (as user turns, for instruction data)."""
    prompts = list(recipe.eval.sample_prompts)
    if isinstance(data, InstructionData):  # fine-tuned on instructions: ask in chat form
        prompts = [data.chat_prompt(p) for p in prompts]
    return sample_texts(
        model,
        data.tokenizer,
        prompts,
        max_new_tokens=recipe.eval.sample_tokens,
        key=jax.random.key(recipe.train.seed),
        temperature=recipe.eval.temperature,
        top_k=recipe.eval.top_k or None,
    )


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
        raise RecipeError(
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


def source_losses(model: CausalLM, data: MixtureData, recipe: Recipe) -> list[tuple]:
    """(label, mean validation loss, tokens scored, bytes per token) of each mixture source
    whose validation split holds more than one window."""
    seq_len, bs = recipe.data.seq_len, eval_batch_size(recipe)
    out = []
    for label, source in zip(data.labels, data.sources, strict=True):
        if source.val.shape[0] <= seq_len:
            continue
        loss, n = evaluate_tokens(
            model,
            source.val,
            batch_size=bs,
            seq_len=seq_len,
            max_batches=recipe.eval.batches or None,
        )
        out.append((label, loss, n, source.bytes_per_token("val")))
    return out


def format_eval(result: dict) -> list[str]:
    lines = []
    if "val" in result:
        v, u = result["val"], result["unigram"]
        lines.append(
            f"validation: loss {v['loss']:.4f}  perplexity {v['perplexity']:.2f}  "
            f"bits/byte {v['bpb']:.4f}  (unigram baseline {u['bpb']:.4f} bits/byte)"
        )
    for label, r in result.get("sources", {}).items():
        lines.append(
            f"validation of source {label}: loss {r['loss']:.4f}  bits/byte {r['bpb']:.4f}"
        )
    for label, r in result.get("extra", {}).items():
        lines.append(
            f"{label}: loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}  "
            f"bits/byte {r['bpb']:.4f}"
        )
    return lines
