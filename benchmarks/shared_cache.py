"""Cache bytes per request of Gemma 4 E2B and E4B, whose last layers share earlier layers' keys
and values (`attention.kv_shared_layers`), against the same models with every layer keeping its
own, as the serving engine sizes them (`eqllm.generation.sizing.request_bytes`: whole blocks of
16 positions of every layer's pool; a kv-shared layer has none). Nothing runs: the models are
shape-only skeletons, so the figures do not depend on the machine.

    python benchmarks/shared_cache.py [--models gemma4-e2b,gemma4-e4b] [--lengths 4096,32768]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax

import eqllm
from eqllm.generation.paged import bytes_per_token
from eqllm.generation.sizing import request_bytes

HEADER = [
    "| model | compute dtype | context | B per position | MiB per request | unshared B per "
    "position | unshared MiB | unshared / shared |",
    "|---|---|---|---|---|---|---|---|",
]


def _skeleton(config):
    return eqx.filter_eval_shape(eqllm.CausalLM, config, key=jax.random.key(0))


def rows(name: str, lengths: list[int], dtypes: list[str]) -> list[str]:
    out = []
    for dtype in dtypes:
        config = eqllm.zoo.config(name, compute_dtype=dtype)
        alone = config.replace(**{"attention.kv_shared_layers": None, "mlp.kv_shared_d_ff": None})
        shared, unshared = _skeleton(config), _skeleton(alone)
        for length in lengths:
            a, b = request_bytes(shared, length), request_bytes(unshared, length)
            out.append(
                f"| {name} | {dtype} | {length:,} | {bytes_per_token(shared):,} | "
                f"{a / 2**20:,.1f} | {bytes_per_token(unshared):,} | {b / 2**20:,.1f} | "
                f"{b / a:.2f}x |"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma4-e2b,gemma4-e4b")
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    lines = list(HEADER)
    for name in args.models.split(","):
        lines += rows(name, lengths, dtypes)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
