"""Generation speed: eqllm.generate against transformers' generate, on CPU, random weights, fp32.

For each model and batch size: prefill tokens/s (one pass over the prompts, first token
sampled) and decode tokens/s (the remaining new tokens), greedy, no stop token, compilation
excluded. Also the memory-bandwidth bound of decode: bytes of weights + KV cache read per step
divided by the measured copy bandwidth.

    PYTHONPATH=$PWD python benchmarks/generate.py [--models gpt2-small llama-125m]
        [--batches 1 8] [--prompt 64] [--new 128] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import equinox as eqx
import jax
import numpy as np

import eqllm
from eqllm import zoo
from eqllm.hub import to_hf_config


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large numpy copy; the best of `repeats`."""
    src = np.ones(megabytes * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_eqllm(model, prompts, new: int, repeats: int) -> tuple[float, float]:
    """(seconds for prefill + first token, seconds for prefill + `new` tokens)."""
    key = jax.random.key(0)

    def run(n):
        return lambda: eqllm.generate_batch(
            model, prompts, max_new_tokens=n, key=key, temperature=0
        )

    run(1)(), run(new)()  # compile both
    out = run(new)()
    assert all(len(row) == new for row in out)
    return best_time(run(1), repeats), best_time(run(new), repeats)


def time_transformers(name: str, prompts, new: int, repeats: int) -> tuple[float, float]:
    import torch
    import transformers

    hf = to_hf_config(zoo.config(name))
    hf.pop("architectures"), hf.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.as_tensor(np.asarray(prompts), dtype=torch.long)

    def run(n):
        def go():
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            assert out.shape[1] == ids.shape[1] + n

        return go

    run(2)()  # warm up
    return best_time(run(1), repeats), best_time(run(new), 1)


def decode_bytes(model, batch: int, prompt: int, new: int) -> float:
    """Bytes read per decode step: every weight once, plus each row's cache at mean length."""
    cfg = model.config
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    mean_context = prompt + new / 2
    per_position = cfg.n_layers * 2 * cfg.attention.n_kv_heads * cfg.head_dim * 4  # k and v, fp32
    return weights + batch * mean_context * per_position


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "llama-125m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth()
    print(
        f"CPU threads {args.threads} (jax: {jax.devices()[0].device_kind}), copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (read + write), prompt {args.prompt}, new {args.new}, fp32"
    )
    header = (
        f"{'model':<12} {'batch':>5} {'impl':<13} {'prefill tok/s':>13} {'decode tok/s':>12} "
        f"{'bound tok/s':>11} {'of bound':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models:
        model = zoo.create(name, key=jax.random.key(0))
        vocab = model.config.vocab_size
        for batch in args.batches:
            prompts = np.random.default_rng(0).integers(0, vocab, (batch, args.prompt))
            bound = batch * bandwidth / decode_bytes(model, batch, args.prompt, args.new)
            results = [("eqllm (jax)", time_eqllm(model, prompts, args.new, args.repeats))]
            if not args.no_torch:
                torch_times = time_transformers(name, prompts, args.new, args.repeats)
                results.append(("transformers", torch_times))
            for impl, (prefill_s, total_s) in results:
                prefill = batch * args.prompt / prefill_s
                decode = batch * (args.new - 1) / (total_s - prefill_s)
                print(
                    f"{name:<12} {batch:>5} {impl:<13} {prefill:>13.0f} {decode:>12.1f} "
                    f"{bound:>11.1f} {decode / bound:>8.0%}",
                    flush=True,
                )
        del model


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    main()
