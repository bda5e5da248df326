"""Per-device memory of big models on a notional 8-device node, from shapes alone.

    python benchmarks/mesh_memory.py [--models llama3-8b llama2-13b] [--batch 8 --seq 4096]

For each mesh: parameters, gradients and AdamW moments per device (fp32, exact, from the
sharding rules applied to eval_shape'd parameters) and the activation estimate of
`eqllm.sharding.estimate_memory` (bf16 compute, full remat). Nothing is allocated.
"""

import argparse

import eqllm
from eqllm.sharding import estimate_memory

MESHES = [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "llama2-13b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    gib = 2**30
    print(f"global batch {args.batch} x {args.seq} tokens, bf16 compute, full remat, fp32 AdamW")
    print(
        f"{'model':<12}{'mesh (d,f,t)':<14}{'params':>9}{'grads':>9}{'adam':>9}"
        f"{'p+g+adam':>10}{'activ.':>9}{'total GiB':>11}"
    )
    for name in args.models:
        cfg = eqllm.zoo.config(name, compute_dtype="bfloat16", remat="full")
        for d, f, t in MESHES:
            e = estimate_memory(
                cfg, {"data": d, "fsdp": f, "tensor": t}, batch_size=args.batch, seq_len=args.seq
            )
            state = e.params + e.grads + e.optimizer
            print(
                f"{name:<12}{f'({d},{f},{t})':<14}{e.params / gib:>9.2f}{e.grads / gib:>9.2f}"
                f"{e.optimizer / gib:>9.2f}{state / gib:>10.2f}{e.activations / gib:>9.2f}"
                f"{e.total / gib:>11.2f}"
            )


if __name__ == "__main__":
    main()
