"""`eqllm bench --mesh`: the compiled training step on a device mesh, measured without running it.

For each mesh, the real step (forward, backward, AdamW, metrics; model and optimizer state
donated) is compiled from shapes alone (nothing is allocated, so a model larger than the host
can be measured) and read two ways:

- memory per device from XLA's buffer assignment (`compiled.memory_analysis()`): arguments
  (parameters, optimizer state, batch), outputs, temporaries (activations, gradients, gathered
  weights), and the argument bytes the outputs reuse (donation);
- collectives, counted by kind in the optimised HLO: inside the layer loop's bodies (each run
  once per layer) and per step (everything, loop bodies times their trip counts); with the
  bytes of their results, and the shapes that are all-gathered (so a test can tell which
  arrays move: expert weights must not, under expert parallelism).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqllm.bench.collectives import collectives, gathered, tally
from eqllm.bench.hlo import Program
from eqllm.config import ModelConfig
from eqllm.lora import trainable
from eqllm.model import CausalLM
from eqllm.recipe import OptimSpec
from eqllm.sharding import (
    MeshConfig,
    batch_sharding,
    make_mesh,
    param_shardings,
    shardings_like_params,
)
from eqllm.train.optim import make_optimizer
from eqllm.train.step import TrainStep


@dataclasses.dataclass
class MeshResult:
    """Per-device memory (bytes) and collectives of one variant's compiled step on one mesh."""

    variant: str
    mesh: str
    batch: int
    seq: int
    n_layers: int
    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    per_layer: dict[str, int]  # collectives inside the layer loop bodies, per layer
    per_step: dict[str, int]  # all collectives executed in one step
    # the bytes of those collectives' results, by kind
    per_layer_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    per_step_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    gathered_shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    optimizer: str = "adamw"
    # FLOPs one device runs in a step (XLA's cost analysis, scaled by the loops' trip counts): a
    # computation every device repeats on whole arrays shows up here, not in the bytes
    flops: float = 0.0

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries, the outputs that reuse donated arguments once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


@dataclasses.dataclass
class AbstractState:
    """A model and its optimizer state as `jax.ShapeDtypeStruct`s placed on a mesh by the
    sharding rules: what a training step compiles against without allocating anything."""

    model: Any
    opt_state: Any
    optimizer: Any  # the optax transformation
    shardings: Any  # the parameters' NamedShardings (eqllm.sharding.param_shardings)


def abstract_state(shapes, mesh, optim: OptimSpec, total_steps: int) -> AbstractState:
    """`shapes` (a model's `eqx.filter_eval_shape`) placed on `mesh`, with the AdamW state of
    `optim` for its trainable arrays (`eqllm.lora.trainable`: all of them, or the adapters)
    placed like their parameters, as `eqllm run` places them."""
    shardings = param_shardings(shapes, mesh)
    model = _abstract(shapes, shardings)
    # make_optimizer reads the weight-decay mask and the parameter groups from dtypes, ranks
    # and the modules' metadata only: stand-ins suffice
    stand_ins = jax.tree.map(lambda x: jnp.zeros((1,) * len(x.shape), x.dtype), shapes)
    optimizer = make_optimizer(optim, total_steps, stand_ins)
    spec = trainable(stand_ins)
    params = eqx.filter(model, spec)
    state = eqx.filter_eval_shape(optimizer.init, params)
    state = _abstract(state, shardings_like_params(state, params, eqx.filter(shardings, spec)))
    return AbstractState(model, state, optimizer, shardings)


def mesh_bench(
    variant: str,
    config: ModelConfig,
    mesh_text: str,
    *,
    batch: int,
    seq: int,
    optim: OptimSpec | None = None,
) -> MeshResult:
    """Compile `config`'s training step on the mesh `mesh_text` ("fsdp=8") and measure it,
    with the optimizer of `optim` (default AdamW)."""
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    state = abstract_state(shapes, mesh, optim or OptimSpec(), 1000)
    step = TrainStep(state.optimizer, lambda _: 1e-3, param_shardings=state.shardings)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=batch_sharding(mesh))
    t0 = time.perf_counter()
    compiled = step.lower(state.model, state.opt_state, tokens).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    program = Program(compiled.as_text())
    found = collectives(program)
    cost = compiled.cost_analysis()
    flops = float(cost.get("flops", 0.0)) * program.loop_factor("flops") if cost else 0.0
    per_layer, per_step = tally(found, lambda c: 1)
    per_layer_bytes, per_step_bytes = tally(found, lambda c: c.result_bytes)
    return MeshResult(
        variant=variant,
        mesh=",".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device",
        batch=batch,
        seq=seq,
        n_layers=config.n_layers,
        compile_s=compile_s,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        per_layer=per_layer,
        per_step=per_step,
        per_layer_bytes=per_layer_bytes,
        per_step_bytes=per_step_bytes,
        gathered_shapes=gathered(found),
        optimizer=(optim or OptimSpec()).name,
        flops=flops,
    )


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in counts.items() if v) or "none"


def mesh_markdown(results: list[MeshResult]) -> str:
    """A markdown table: MiB per device, collectives per layer / per step, and the MiB the
    step's collectives return and the GFLOPs it runs, per device."""
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    lines = [
        "| variant | optimizer | mesh | arguments MiB | outputs MiB | temporaries MiB | total MiB "
        "| collectives per layer | collectives per step | collective MiB per step | GFLOP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.variant} | {r.optimizer} | {r.mesh} | {mib(r.argument_bytes)} | "
            f"{mib(r.output_bytes)} | {mib(r.temp_bytes)} | {mib(r.total_bytes)} | "
            f"{_counts(r.per_layer)} | {_counts(r.per_step)} | "
            f"{mib(sum(r.per_step_bytes.values()))} | {r.flops / 1e9:,.2f} |"
        )
    return "\n".join(lines)


MESH_NOTE = (
    "Memory per device from XLA's buffer assignment of the compiled step (total = arguments + "
    "outputs + temporaries - outputs written into donated arguments). Collectives counted in "
    "the optimised HLO: per layer = ops inside the layer loop's bodies (forward and backward), "
    "per step = every op times the trip count of the loops around it; collective MiB = the "
    "bytes of their results on one device. GFLOP = what one device computes in a step (XLA's "
    "cost analysis, loops counted by their trip counts). The step is compiled, not run."
)
