"""Validation perplexity of a trained model with fp32, bf16 and int8 weights.

Takes a run folder written by `eqllm run` (the quickstart, say: a nano Llama trained on the
Python standard library's source) and scores its held-out validation split, the same tokens
and windows `eqllm eval RUN` scores, with the checkpoint's weights as trained (fp32), cast to
bfloat16 (weights and compute) and quantized to int8 (`eqllm.quantize`: weight-only, one scale
per output channel, compute in fp32). The fp32 row equals the run's own evaluation.

    eqllm run quickstart --out runs/quickstart
    PYTHONPATH=$PWD python benchmarks/weights_perplexity.py runs/quickstart [--batches N]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import equinox as eqx
import jax

import eqllm
from eqllm.data import prepare
from eqllm.eval.evaluate import eval_batch_size
from eqllm.eval.metrics import evaluate_tokens
from eqllm.hub.model_folder import with_param_dtype
from eqllm.loading import load_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder written by `eqllm run`")
    parser.add_argument("--batches", type=int, default=None, help="score only the first N")
    args = parser.parse_args()
    model, _, recipe, meta = load_run(args.run)
    data = prepare(
        recipe.data.source.to_source(),
        args.run / "tokenizer.json",
        cache_dir=recipe.data.cache_dir or None,
        val_fraction=recipe.data.val_fraction,
        seed=recipe.data.split_seed,
    )
    batch, seq_len = eval_batch_size(recipe), recipe.data.seq_len
    print(f"{args.run} at step {meta['step']}: {model.config.family}, {len(data.val)} val tokens")
    print("| weights | MB | val loss | perplexity | vs fp32 |\n|---|---|---|---|---|")
    reference = None
    for kind, variant in (
        ("fp32", lambda: model),
        ("bf16", lambda: with_param_dtype(model, "bfloat16")),
        ("int8", lambda: eqllm.quantize(model, "int8")),
    ):
        weights = variant()
        mb = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(weights, eqx.is_array))) / 1e6
        loss, _ = evaluate_tokens(
            weights, data.val, batch_size=batch, seq_len=seq_len, max_batches=args.batches
        )
        ppl = math.exp(loss)
        reference = reference or ppl
        print(f"| {kind} | {mb:.2f} | {loss:.4f} | {ppl:.3f} | {ppl / reference - 1:+.2%} |")


if __name__ == "__main__":
    main()
