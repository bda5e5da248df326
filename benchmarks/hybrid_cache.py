"""Cache bytes per request of a hybrid against an all-attention model of the same sizes, as the
serving engine sizes them (`eqllm.generation.sizing.request_bytes`: its attention layers'
blocks, plus the recurrent state of its linear-attention layers in the request's slot); and of
a stack of Mamba-2 layers alone, which has no attention layer: its state is all it keeps; and
of Falcon-H1, whose every layer runs attention and Mamba-2 side by side: it keeps the
all-attention twin's keys and values and a Mamba-2 state per layer on top (a ratio below 1).

The all-attention twin is the same config with `linear = None`: the same layers, heads and
dims, every layer full attention (a stack without attention layers has no such twin: "-").
Nothing runs: the models are shape-only skeletons.

    python benchmarks/hybrid_cache.py [--models qwen3.5-0.8b,mamba2-780m,falcon-h1-0.5b]
        [--lengths 4096,32768]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax

import eqllm
from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.sizing import request_bytes

HEADER = [
    "| model | compute dtype | context | attention KV MiB | recurrent state MiB | total MiB "
    "| all attention MiB | all attention / model |",
    "|---|---|---|---|---|---|---|---|",
]


def table(name: str, lengths: list[int], dtypes: list[str]) -> tuple[list[str], list[str]]:
    """Markdown rows of `name`: per compute dtype and length, its bytes and its all-attention
    twin's; and a line per dtype with the sizes they come from."""
    notes, rows = [], []
    for dtype in dtypes:
        config = eqllm.zoo.config(name, compute_dtype=dtype)
        pure = config.linear is not None and config.linear.pure  # no attention layer: no twin
        model, full = (
            None if c is None else eqx.filter_eval_shape(eqllm.CausalLM, c, key=jax.random.key(0))
            for c in (config, None if pure else config.replace(linear=None))
        )
        for n in lengths:
            h, s = request_bytes(model, n), state_bytes(model)
            twin = (
                "- | -"
                if full is None
                else (f"{request_bytes(full, n) / 2**20:,.1f} | {request_bytes(full, n) / h:.2f}x")
            )
            rows.append(
                f"| {name} | {dtype} | {n:,} | {(h - s) / 2**20:,.1f} | {s / 2**20:,.2f} | "
                f"{h / 2**20:,.1f} | {twin} |"
            )
        kinds = config.layer_kinds()
        attention = "" if full is None else f" (all attention: {bytes_per_token(full):,})"
        notes.append(
            f"{name}, {dtype}: {kinds.count('full')} of {len(kinds)} layers attention, "
            f"{bytes_per_token(model):,} B per position{attention}, recurrent state "
            f"{state_bytes(model):,} B per request"
        )
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3.5-0.8b,mamba2-780m,falcon-h1-0.5b")
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, notes = list(HEADER), []
    for name in args.models.split(","):
        more, said = table(name, lengths, args.dtypes.split(","))
        rows, notes = rows + more, notes + said
    print("\n".join([*rows, "", *notes]))


if __name__ == "__main__":
    main()
