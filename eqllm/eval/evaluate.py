"""The end-of-run evaluation: validation, the unigram baseline, extra sources and samples.

What a run scores is its `eqllm.runs.HeldOut` (written into the run folder when it starts), so
`eqllm eval` of a run folder gives the numbers the run gave, with or without its data.
"""

from __future__ import annotations

import jax

from eqllm.data import MixtureData, TokenData, Tokenizer, prepare
from eqllm.data.instruct import ChatFormat, InstructionData
from eqllm.data.prompts import PromptData
from eqllm.eval.metrics import evaluate_tokens, loss_report, unigram_loss
from eqllm.generation import generate_batch
from eqllm.model import CausalLM
from eqllm.recipe import Recipe, RecipeError
from eqllm.runs import HeldOut, HeldOutSource


def eval_batch_size(recipe: Recipe) -> int:
    return recipe.eval.batch_size or recipe.train.batch_size


def heldout_of(
    data: TokenData | MixtureData | InstructionData | PromptData, recipe: Recipe
) -> HeldOut:
    """What the run's evaluations score (`eqllm.runs.HeldOut`): the validation tokens they read,
    bytes per token, the unigram baseline and a mixture's sources, from the prepared data."""
    seq_len, bs, batches = recipe.data.seq_len, eval_batch_size(recipe), recipe.eval.batches
    kept = dict(batch_size=bs, seq_len=seq_len, batches=batches)
    val = data.val
    unigram = None
    if val.shape[0] > seq_len:
        unigram = unigram_loss(data.train, val, data.tokenizer.vocab_size)
    sources = {}
    if isinstance(data, MixtureData):  # each source of a mixture on its own validation split
        for label, source in zip(data.labels, data.sources, strict=True):
            sources[label] = HeldOutSource(
                HeldOut.evaluated(source.val, **kept), source.bytes_per_token("val")
            )
    bpt = data.bytes_per_token("val") if val.shape[0] > seq_len else 0.0
    return HeldOut(HeldOut.evaluated(val, **kept), bpt, unigram, sources)


def evaluate_heldout(model: CausalLM, heldout: HeldOut, recipe: Recipe) -> dict:
    """Validation loss/perplexity/bpb and the unigram baseline (``val``, ``unigram``), and each
    mixture source's (``sources``), over the held-out tokens; {} when they hold no window."""
    seq_len, bs = recipe.data.seq_len, eval_batch_size(recipe)
    max_batches = recipe.eval.batches or None
    result: dict = {}
    if heldout.tokens.shape[0] > seq_len:
        loss, n = evaluate_tokens(
            model, heldout.tokens, batch_size=bs, seq_len=seq_len, max_batches=max_batches
        )
        bpt = heldout.bytes_per_token
        result["val"] = {**loss_report(loss, bpt), "tokens": n}
        if heldout.unigram_loss is not None:
            result["unigram"] = loss_report(heldout.unigram_loss, bpt)
    for label, source in heldout.sources.items():
        if source.tokens.shape[0] <= seq_len:
            continue
        loss, n = evaluate_tokens(
            model, source.tokens, batch_size=bs, seq_len=seq_len, max_batches=max_batches
        )
        result.setdefault("sources", {})[label] = {
            **loss_report(loss, source.bytes_per_token),
            "tokens": n,
        }
    return result


def evaluate_run(
    model: CausalLM,
    heldout: HeldOut,
    recipe: Recipe,
    tokenizer: Tokenizer,
    *,
    chat: ChatFormat | None = None,
    samples: bool = True,
    progress: bool = False,
) -> dict:
    """Validation loss/perplexity/bpb, the unigram baseline, extra sources and samples.

    Returns a JSON-ready dict: ``val`` (loss, perplexity, bpb, tokens), ``unigram`` (loss, bpb),
    ``sources`` (a mixture's, per label), ``extra`` (per source label), ``samples`` (list of
    texts; the prompts as user turns in the `chat` format when one is given).
    """
    seq_len, bs = recipe.data.seq_len, eval_batch_size(recipe)
    max_batches = recipe.eval.batches or None
    result = evaluate_heldout(model, heldout, recipe)
    for i, spec in enumerate(recipe.eval.extra_sources):
        label = spec.label or spec.path or spec.name or f"extra{i}"
        extra = prepare(
            spec.to_source(),
            tokenizer,
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
        result["samples"] = recipe_samples(model, tokenizer, recipe, chat)
    return result


def recipe_samples(
    model: CausalLM, tokenizer: Tokenizer, recipe: Recipe, chat: ChatFormat | None = None
) -> list:
    """Samples for the recipe's eval.sample_prompts (as user turns in the `chat` format when
    one is given: a model fine-tuned on chats is asked in chat form)."""
    prompts = list(recipe.eval.sample_prompts)
    if chat is not None:
        prompts = [
            chat.render([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in prompts
        ]
    return sample_texts(
        model,
        tokenizer,
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
