"""Speculative decoding on the engine: acceptance rate and speedup, at 1 and at 16 requests.

A random-weight target (default smollm-135m's shape, fp32, on the CPU) generates greedily
from prompts that repeat a random 16-token phrase, without speculation and with K guesses per
round from:

- prompt lookup (n-gram matches in the prompt and the output);
- a draft that is the target's own copy: every guess is kept (acceptance 1), so this row is
  the upper bound of acceptance, at a draft as costly as the target;
- a draft that is the target's first `--draft-layers` layers with its embedding and head (a
  layer-skipping draft, as in LayerSkip, Elhoushi et al. 2024): cheap, and as good as the
  random target's layers are small next to its embedding (trained models differ).

Random weights say nothing about how often a trained draft agrees with a trained target: read
the acceptance as a property of these models and prompts, and the speedup as what the engine
makes of that acceptance. Each setting runs once to compile and once timed; greedy outputs are
checked equal to the run without speculation.

    PYTHONPATH=$PWD python benchmarks/speculative.py [--model smollm-135m] [--k 4]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm.serve import Engine, Params, Token


def truncated(model: eqllm.CausalLM, layers: int) -> eqllm.CausalLM:
    """The model's first `layers` layers, with its embedding, final norm and head."""
    small = eqllm.CausalLM(model.config.replace(n_layers=layers), key=jax.random.key(0))
    blocks = jax.tree.map(lambda a: a[:layers], model.blocks)
    small = eqx.tree_at(
        lambda m: (m.embed, m.blocks, m.final_norm), small, (model.embed, blocks, model.final_norm)
    )
    if model.lm_head is not None:
        small = eqx.tree_at(lambda m: m.lm_head, small, model.lm_head)
    return small


def prompts(n: int, vocab: int, length: int) -> list[list[int]]:
    """`n` prompts, each a random 16-token phrase repeated to `length` tokens."""
    rng = np.random.default_rng(0)
    return [np.tile(rng.integers(0, vocab, 16), length // 16).tolist() for _ in range(n)]


def run(model, batch, new, speculate=None, draft=None) -> tuple[float, list, dict]:
    """Seconds for `batch` requests of `new` greedy tokens at once (the second of two runs),
    the outputs and the engine's counters."""
    engine = Engine(
        model,
        max_batch=16,
        max_len=256,
        prefill_chunk=1024,
        kv_blocks=16 * 16,
        prefix_cache=False,
        view_lengths=(256,),  # one view bucket: fewer shapes to compile
        speculate=speculate,
        draft=draft,
    )
    for attempt in range(2):
        outs = [[] for _ in range(batch)]
        for prompt, out in zip(prompts(batch, model.config.vocab_size, 64), outs, strict=True):
            engine.submit(prompt, Params(max_tokens=new, temperature=0.0), out.append)
        engine.step(decode=False)  # the prompts (timed apart from the decoding)
        start = time.perf_counter()
        engine.run(max_rounds=new + 10)
        seconds = time.perf_counter() - start
        if attempt == 0 and engine.speculator is not None:  # count the timed run only
            engine.speculator.proposed = engine.speculator.accepted = 0
            engine.speculator.rounds = 0
    counters = engine.stats()
    if engine.speculator is not None:  # rounds x requests in them
        counters["rounds"] = engine.speculator.rounds
    tokens = [[e.id for e in out if isinstance(e, Token)] for out in outs]
    return seconds, tokens, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm-135m")
    parser.add_argument("--k", type=int, default=4, help="guesses per round")
    parser.add_argument("--draft-layers", type=int, default=3)
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--clients", default="1,16")
    args = parser.parse_args()
    model = eqllm.zoo.create(args.model, key=jax.random.key(0))
    sources = {
        "off": {},
        "prompt lookup": {"speculate": args.k},
        "draft: target's copy": {"speculate": args.k, "draft": model},
        f"draft: first {args.draft_layers} layers": {
            "speculate": args.k,
            "draft": truncated(model, args.draft_layers),
        },
    }
    print(f"{args.model} (random weights, fp32, CPU), greedy, 64-token prompts, {args.new} new")
    print("| requests | guesses from | K | acceptance | tokens per round | tokens/s | speedup |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(c) for c in args.clients.split(",")]:
        base = None
        for name, settings in sources.items():
            seconds, tokens, stats = run(model, batch, args.new, **settings)
            if base is None:
                base, expected = seconds, tokens
            assert tokens == expected, f"{name}: greedy output differs from plain decoding"
            rate, rounds = stats.get("speculative_acceptance"), stats.get("rounds")
            k = settings.get("speculate", "-")
            accepted = "-" if rate is None else f"{rate:.2f}"
            # every token but each request's first (the prefill's) comes from a round
            per_round = "1" if rounds is None else f"{batch * (args.new - 1) / rounds:.2f}"
            speed = batch * args.new / seconds
            print(
                f"| {batch} | {name} | {k} | {accepted} | {per_round} | {speed:.1f} | "
                f"{base / seconds:.2f}x |"
            )


if __name__ == "__main__":
    main()
