"""Pipeline parallelism on 8 simulated CPU devices: memory, collectives, bubble and loss.

    python benchmarks/pipeline.py        # sets XLA_FLAGS for 8 simulated devices itself

For each (mesh, microbatches), compiles eqllm's real train step (forward, backward, AdamW) for a
small Llama with its layers scanned and reports, per device, what XLA's memory analysis of the
compiled step gives (arguments: parameters, optimizer state and batch; temporaries:
activations and gradients), the collectives in the optimised HLO, the bubble fraction
(stages-1)/(microbatches+stages-1), and the first step's loss against the plain data=8 step
(the pipeline changes the schedule, not the values). Simulated devices share the host's cores,
so no step time is reported: a GPipe pipeline only saves time where stages run on their own
hardware.
"""

import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import eqllm  # noqa: E402
from eqllm.recipe import OptimSpec  # noqa: E402
from eqllm.sharding import (  # noqa: E402
    MeshConfig,
    batch_sharding,
    make_mesh,
    param_shardings,
    shard_model,
)
from eqllm.train import Pipeline, TrainStep, init_opt_state, make_optimizer  # noqa: E402

KINDS = ("collective-permute", "all-reduce", "all-gather")
RUNS = [
    ("data=8", 1),
    ("pipeline=2,data=4", 4),
    ("pipeline=4,data=2", 2),
    ("pipeline=4,data=2", 8),
    ("pipeline=8", 8),
    ("pipeline=2,data=2,fsdp=2", 4),
]


def main() -> int:
    cfg = eqllm.zoo.config(
        "llama-nano",
        d_model=128,
        n_layers=8,
        attention={"n_heads": 8, "n_kv_heads": 8},
        mlp={"d_ff": 512},
        vocab_size=4096,
        max_seq_len=128,
        scan_layers=True,
    )
    batch = jax.random.randint(jax.random.key(1), (16, 129), 0, cfg.vocab_size)
    print(
        f"llama-nano width {cfg.d_model}, {cfg.n_layers} layers, batch 16 x seq 128, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, jax {jax.__version__}"
    )
    header = ["mesh", "microbatches", "bubble", "args MiB", "temp MiB", *KINDS, "loss rel. diff"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    reference = None
    for text, microbatches in RUNS:
        mesh = make_mesh(MeshConfig.parse(text))
        model = eqllm.CausalLM(cfg, key=jax.random.key(0))  # fresh: the step donates it
        sharded, shardings = shard_model(model, mesh), param_shardings(model, mesh)
        optimizer = make_optimizer(OptimSpec(), 100, eqx.filter(sharded, eqx.is_array))
        opt_state = init_opt_state(optimizer, sharded, shardings)
        stages = mesh.shape["pipeline"]
        pipeline = Pipeline(stages, microbatches, mesh) if stages * microbatches > 1 else None
        step = TrainStep(optimizer, lambda _: 1e-3, param_shardings=shardings, pipeline=pipeline)
        placed = jax.device_put(batch, batch_sharding(mesh))
        compiled = step.lower(sharded, opt_state, placed).compile()
        hlo = compiled.compiled.as_text()
        memory = compiled.compiled.memory_analysis()
        counts = [len(re.findall(rf"= [^=]*\b{k}(-start)?\(", hlo)) for k in KINDS]
        _, _, metrics = compiled(placed, sharded, opt_state)
        loss = float(metrics["loss"])
        reference = loss if reference is None else reference
        bubble = 0.0 if pipeline is None else pipeline.bubble
        cells = [
            text,
            str(microbatches),
            f"{bubble:.3f}",
            f"{memory.argument_size_in_bytes / 2**20:.2f}",
            f"{memory.temp_size_in_bytes / 2**20:.2f}",
            *map(str, counts),
            f"{abs(loss - reference) / reference:.1e}",
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    eqllm.configure_process()  # as the eqllm command does, before JAX starts
    sys.exit(main())
