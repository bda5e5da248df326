"""Cache bytes per request of a hybrid against an all-attention model of the same sizes, as the
serving engine sizes them (`eqllm.generation.sizing.request_bytes`: its attention layers'
blocks, plus the recurrent state of its linear-attention layers in the request's slot).

The all-attention twin is the same config with `linear = None`: the same layers, heads and
dims, every layer full attention. Nothing runs: the models are shape-only skeletons.

    python benchmarks/hybrid_cache.py [--model qwen3.5-0.8b] [--lengths 4096,32768]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax

import eqllm
from eqllm.generation.paged import bytes_per_token, state_bytes
from eqllm.generation.sizing import request_bytes


def table(name: str, lengths: list[int], dtypes: list[str]) -> list[str]:
    """Markdown rows: per compute dtype and length, the hybrid's and the twin's bytes; then a
    line per dtype with the sizes they come from."""
    notes, rows = (
        [],
        [
            "| compute dtype | context | hybrid: attention KV MiB | hybrid: recurrent state MiB "
            "| hybrid total MiB | all attention MiB | all attention / hybrid |",
            "|---|---|---|---|---|---|---|",
        ],
    )
    for dtype in dtypes:
        config = eqllm.zoo.config(name, compute_dtype=dtype)
        twin = config.replace(linear=None)
        hybrid, full = (
            eqx.filter_eval_shape(eqllm.CausalLM, c, key=jax.random.key(0)) for c in (config, twin)
        )
        for n in lengths:
            h, f, s = request_bytes(hybrid, n), request_bytes(full, n), state_bytes(hybrid)
            rows.append(
                f"| {dtype} | {n:,} | {(h - s) / 2**20:,.1f} | {s / 2**20:,.2f} | "
                f"{h / 2**20:,.1f} | {f / 2**20:,.1f} | {f / h:.2f}x |"
            )
        kinds = config.layer_kinds()
        notes.append(
            f"{name}, {dtype}: {kinds.count('full')} of {len(kinds)} layers attention, "
            f"{bytes_per_token(hybrid):,} B per position (all attention: "
            f"{bytes_per_token(full):,}), recurrent state {state_bytes(hybrid):,} B per request"
        )
    return [*rows, "", *notes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-0.8b")
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print("\n".join(table(args.model, lengths, args.dtypes.split(","))))


if __name__ == "__main__":
    main()
