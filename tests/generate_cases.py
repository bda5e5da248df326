"""Seeded generation cases whose outputs are pinned in tests/data/generate_golden.json.

The file was written by the compiled generation loop that preceded the serving engine
(`python tests/generate_cases.py --write`, at commit 1fe75d6); `tests/test_generate.py` runs the
same cases through today's code and checks every token. Each case is a tiny perturbed model of
one family, prompts of several lengths, and a sampling setting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

import eqllm

GOLDEN = Path(__file__).parent / "data" / "generate_golden.json"

TINY = {
    "vocab_size": 97,
    "d_model": 32,
    "n_layers": 2,
    "attention.n_heads": 4,
    "mlp.d_ff": 64,
    "max_seq_len": 64,
}
MODELS = {
    "llama3": ("llama3.2-1b", {**TINY, "attention.n_kv_heads": 2}),
    "mistral": ("mistral-7b", {**TINY, "attention.n_kv_heads": 2, "attention.sliding_window": 5}),
    "gemma2": (
        "gemma2-2b",
        {
            **TINY,
            "attention.n_kv_heads": 2,
            "attention.head_dim": 16,
            "attention.query_pre_attn_scalar": 12,
            "attention.sliding_window": 5,
            "attention.softcap": 1.0,
            "final_softcap": 2.0,
        },
    ),
    "gpt2": ("gpt2-nano", TINY),
    "deepseek_v3": ("deepseek_v3-nano", {"vocab_size": 97, "d_model": 32, "max_seq_len": 64}),
    "gpt_oss": (
        "gpt_oss-nano",
        {**TINY, "attention.sliding_window": 6, "attention.head_dim": 8, "n_layers": 2},
    ),
}
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [1, 2], [42] * 20, [7, 8, 9, 10, 11]]
SETTINGS = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 1.0},
    "top_k": {"temperature": 0.8, "top_k": 20},
    "top_p_min_p": {"top_p": 0.9, "min_p": 0.05},
    "penalty_stop": {"temperature": 0.7, "repetition_penalty": 1.3, "stop_tokens": [5, 17]},
}
NEW = 24


def model(name: str) -> eqllm.CausalLM:
    """The tiny model of `name`, every floating parameter perturbed by N(0, 0.1)."""
    zoo_name, overrides = MODELS[name]
    config = eqllm.zoo.config(zoo_name, **_nested(overrides))
    built = eqllm.CausalLM(config, key=jax.random.key(0))
    params, static = eqx.partition(built, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noise = [jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    leaves = [x + 0.1 * n for x, n in zip(leaves, noise, strict=True)]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        group, _, field = key.rpartition(".")
        (out.setdefault(group, {}) if group else out)[field or group] = value
    return out


def run(name: str) -> dict[str, list[list[int]]]:
    """Every setting of one model: generate_batch over PROMPTS (keys split from 7), and
    generate of the first prompt alone (key 3)."""
    m = model(name)
    out = {}
    for label, kw in SETTINGS.items():
        batch = eqllm.generate_batch(m, PROMPTS, max_new_tokens=NEW, key=jax.random.key(7), **kw)
        alone = eqllm.generate(m, PROMPTS[0], max_new_tokens=NEW, key=jax.random.key(3), **kw)
        out[label] = [np.asarray(r).tolist() for r in batch] + [np.asarray(alone).tolist()]
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/generate_cases.py --write")
    GOLDEN.write_text(json.dumps({name: run(name) for name in MODELS}, indent=1) + "\n")
