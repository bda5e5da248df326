"""eqllm's attention core against PyTorch's fused CPU kernel, forward + backward, same shapes.

    python benchmarks/attention_core.py [--batch 16 --seq 256 --heads 6 --kv-heads 2 --head-dim 64]

Times `eqllm.nn.attention.in_order_attention` (causal, positions 0..seq-1; compiled with
`jax.jit(jax.grad(...))`) and `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`
(its flash kernel on CPU), each taking the gradient of sum(out * q) with respect to q, k and v.
The two run alternately, call by call, so machine noise hits both alike; the figure printed is
the median per call and per layer. The inputs are the attention's only: the projections, rotary
embedding and everything else in a layer are left out, so this isolates the part of the step
where XLA's CPU backend has no fused kernel.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqllm
from eqllm.bench.torch_bench import cpu_threads, import_torch
from eqllm.nn.attention import in_order_attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    torch, _ = import_torch()
    torch.set_num_threads(cpu_threads())
    rng = np.random.default_rng(0)
    shapes = [
        (args.batch, args.seq, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)
    ]
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in shapes)

    def loss(q, k, v):
        return jnp.sum(in_order_attention(q, k, v) * q)

    jax_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jq, jk, jv = (jnp.asarray(a) for a in (q, k, v))
    # PyTorch wants (batch, heads, seq, head_dim); the transposes are part of its call, as
    # they are of a transformers layer.
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))

    def torch_call():
        out = torch.nn.functional.scaled_dot_product_attention(
            tq.transpose(1, 2),
            tk.transpose(1, 2),
            tv.transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)
        return torch.autograd.grad((out * tq).sum(), (tq, tk, tv))

    def jax_call():
        return jax.block_until_ready(jax_grad(jq, jk, jv))

    jax_out, torch_out = jax_call(), torch_call()
    pairs = zip(jax_out, torch_out, strict=True)
    err = max(float(np.max(np.abs(np.asarray(a) - b.numpy()))) for a, b in pairs)
    scale = max(float(np.max(np.abs(b.numpy()))) for b in torch_out)
    print(f"gradients agree: max |difference| {err:.2e} (largest gradient {scale:.1f})")
    times: dict[str, list[float]] = {"eqllm (XLA)": [], "torch SDPA": []}
    for _ in range(args.calls):
        for name, call in (("eqllm (XLA)", jax_call), ("torch SDPA", torch_call)):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name:12s} forward + backward: {1e3 * np.median(ts):6.1f} ms per layer (median)")
    ratio = np.median(times["eqllm (XLA)"]) / np.median(times["torch SDPA"])
    print(f"eqllm / torch: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    raise SystemExit(main())
