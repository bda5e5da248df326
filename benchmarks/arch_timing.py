"""The cross-architecture study's timings and cache sizes (benchmarks/arch_study.py): training
tokens/s of the real training step (`eqllm.bench.JaxBench`), decode tokens/s of
`eqllm.generate` (batch 1, greedy, a jitted decode loop) and the engine's cache bytes per
request (`eqllm.generation.sizing.request_bytes`, exact, from shapes alone).

Timings depend on the machine and its load; bytes do not. `measure` times every
(architecture, width) one after the other; `benchmarks/studies.py architectures --retime` calls
it again (on an idle machine) and the page says which measurement it shows.
"""

from __future__ import annotations

import statistics
import time

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm.bench.jax_bench import JaxBench
from eqllm.config import ModelConfig
from eqllm.generation.paged import state_bytes
from eqllm.generation.sizing import chunk_for, request_bytes
from eqllm.recipe import OptimSpec
from eqllm.serve import Engine, Params

CONTEXTS = (2048, 8192)
BATCH, PROMPT, NEW_TOKENS, TRAIN_STEPS = 8, 16, 64, 10


def cache_bytes(cfg: ModelConfig) -> dict:
    """Bytes one request holds in the engine at each of CONTEXTS (float32 caches, as the study
    trains), and the part of it that is recurrent state (not growing with the context)."""
    long = cfg.replace(max_seq_len=max(CONTEXTS))
    model = eqx.filter_eval_shape(eqllm.CausalLM, long, key=jax.random.key(0))
    return {
        "state": state_bytes(model),
        **{str(n): request_bytes(model, n) for n in CONTEXTS},
    }


def train_tokens_per_s(cfg: ModelConfig, seq_len: int) -> float:
    """Median tokens/s of the training step (AdamW) over TRAIN_STEPS steps after two warmup."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (BATCH, seq_len + 1), dtype=np.int32)
    bench = JaxBench(cfg, tokens, optim=OptimSpec(name="adamw", warmup_steps=0))
    bench.compile()
    for _ in range(2):
        bench.step()
    return BATCH * seq_len / statistics.median(bench.step() for _ in range(TRAIN_STEPS))


def decode_tokens_per_s(cfg: ModelConfig, context: int | None = None) -> float:
    """New tokens/s at batch 1, greedy, each shape compiled first, then the best of three. From
    a PROMPT-token prompt (`context` None): `eqllm.generate`, whose prefill is a small part of
    the time. At a `context`: the prompt fills all of it but NEW_TOKENS positions and is
    prefilled first; then one decode call of NEW_TOKENS - 1 tokens (as `eqllm.generate` runs
    them) is timed alone."""
    if context is not None:
        cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, context))
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    length = PROMPT if context is None else context - NEW_TOKENS
    prompt = np.arange(length, dtype=np.int32) % (cfg.vocab_size - 1) + 1
    if context is None:
        key = jax.random.key(0)

        def once() -> float:
            start = time.perf_counter()
            np.asarray(
                eqllm.generate(model, prompt, max_new_tokens=NEW_TOKENS, key=key, temperature=0)
            )
            return time.perf_counter() - start

        once()
        return NEW_TOKENS / min(once() for _ in range(3))

    def decode() -> float:
        engine = Engine(
            model,
            max_batch=1,
            max_len=context,
            prefill_chunk=chunk_for(cfg, length, context),
            prefix_cache=False,
            decode_steps=NEW_TOKENS - 1,
        )
        engine.submit(prompt, Params(max_tokens=NEW_TOKENS, temperature=0), lambda *_: None)
        engine.step(decode=False)  # the prompt, and the first new token
        start = time.perf_counter()
        engine.step()  # one call: the other NEW_TOKENS - 1
        return time.perf_counter() - start

    decode()
    return (NEW_TOKENS - 1) / min(decode() for _ in range(3))


def measure(
    configs: dict[tuple[str, int], ModelConfig],
    seq_len: int,
    *,
    train: bool,
    decode_widths: list[int],
    echo=print,
) -> dict:
    """Per "arch/width": decode tokens/s at `decode_widths` (`decode_at_contexts`) and, when
    `train`, the training
    step's tokens/s. Each costs a compile (minutes on a loaded 2-core machine): without
    `train` the page reads training speed off the sweep's own steps."""
    out = {}
    for (arch, width), cfg in configs.items():
        out[f"{arch}/{width}"] = {}
        if width in decode_widths:
            out[f"{arch}/{width}"] |= decode_at_contexts(cfg)
        if train:
            out[f"{arch}/{width}"]["train_tokens_s"] = train_tokens_per_s(cfg, seq_len)
        echo(f"timed {arch} at {width}: {out[f'{arch}/{width}']}")
    return out


def decode_at_contexts(cfg: ModelConfig) -> dict:
    """Decode tokens/s after a short prompt ("decode_tokens_s") and at each of CONTEXTS
    ("decode_2048_tokens_s", ...), where attention reads the whole cache at every token and a
    linear layer its fixed state."""
    out = {"decode_tokens_s": decode_tokens_per_s(cfg)}
    return out | {f"decode_{n}_tokens_s": decode_tokens_per_s(cfg, n) for n in CONTEXTS}
