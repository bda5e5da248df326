"""Step time of each optimizer on one model: the real training step (`eqllm.bench.JaxBench`:
`TrainStep` + `make_optimizer`), same weights and batch.

    python benchmarks/optimizer_step.py [--variant llama-nano --batch 8 --seq 128 --steps 20]
        [--optimizers adamw,muon,soap,soap:1024] [--set d_model=256 --set n_layers=2 ...]

Prints, per optimizer, the compile time and the mean and median step time over `--steps`
steps after two warmup steps. The mean counts SOAP's eigenbasis refresh (every
`soap_precondition_frequency` = 10 steps); the median is a step without one. The optimizers
run one after the other, so machine noise is not shared: rerun on a loaded machine.
"soap:N" is SOAP with `soap_max_precond_dim` N (1024 leaves llama-nano's 4096-token vocabulary
side unpreconditioned; the default 10000 preconditions it, a 4096 x 4096 eigendecomposition).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from eqllm import zoo
from eqllm.bench.jax_bench import JaxBench, bench_config
from eqllm.recipe import OptimSpec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="llama-nano")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizers", default="adamw,muon,soap")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a ModelConfig field"
    )
    args = parser.parse_args(argv)
    changes = dict(item.split("=", 1) for item in args.set)
    variant = zoo.config(args.variant).replace(**{k: json.loads(v) for k, v in changes.items()})
    config = bench_config(variant, args.seq)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
    sets = "".join(f" {item}" for item in args.set)
    print(f"{args.variant}{sets}, batch {args.batch} x seq {args.seq}, {args.steps} timed steps")
    print("| optimizer | compile s | mean step ms | median step ms |")
    print("|---|---|---|---|")
    for entry in args.optimizers.split(","):
        name, _, max_dim = entry.partition(":")
        extra = {"soap_max_precond_dim": int(max_dim)} if max_dim else {}
        bench = JaxBench(config, tokens, optim=OptimSpec(name=name, warmup_steps=0, **extra))
        compile_s = bench.compile()
        for _ in range(2):
            bench.step()
        times = [bench.step() * 1e3 for _ in range(args.steps)]
        mean, median = statistics.mean(times), statistics.median(times)
        print(f"| {entry} | {compile_s:.1f} | {mean:.1f} | {median:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
