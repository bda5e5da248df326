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
import math
import re
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqllm.config import ModelConfig
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

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries, the outputs that reuse donated arguments once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def count_collectives(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) counts of each collective kind in optimised HLO text.

    "Per layer" counts the ops in while-loop bodies (the scanned layers, forward and backward);
    "per step" multiplies every computation's ops by the trip counts of the loops around it.
    """
    return _collectives(hlo, lambda line, kind: 1)


def collective_bytes(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """(per layer, per step) bytes of each collective kind's results (see `count_collectives`);
    an async `-start` op counts its results, not the operands its tuple repeats."""

    def size(line: str, kind: str) -> int:
        shapes = _result_shapes(line, kind)
        return sum(_DTYPE_BYTES.get(t, 4) * math.prod(d) for t, d in shapes)

    return _collectives(hlo, size)


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The distinct shapes (per device, after the gather) that the HLO's all-gathers produce."""
    found = set()
    for line in hlo.splitlines():
        if _OP["all-gather"].search(line):
            found |= {d for _, d in _result_shapes(line, "all-gather")}
    return sorted(found)


_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"s8": 1, "u8": 1, "pred": 1}
# "kind(" or "kind-start(" as the op, not "%kind.12" as an operand
_OP = {kind: re.compile(rf"(?<![\w%.\-]){kind}(-start)?\(") for kind in KINDS}


def _result_shapes(line: str, kind: str) -> list[tuple[str, tuple[int, ...]]]:
    op = _OP[kind].search(line)
    result = line[line.index("=") + 1 : op.start()]  # "%x = f32[8,4]{1,0} all-gather(...)"
    shapes = [
        (t, tuple(int(n) for n in dims.split(",") if n))
        for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result)
    ]
    if op.group(1):  # -start: (operands..., results...)
        shapes = shapes[len(shapes) // 2 :]
    return shapes


def _collectives(hlo: str, measure) -> tuple[dict[str, int], dict[str, int]]:
    calls: dict[str, tuple[str, int]] = {}  # body -> (computation holding the loop, trips)
    ops: dict[str, dict[str, int]] = {}
    computation = ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
            ops[computation] = dict.fromkeys(KINDS, 0)
            continue
        body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
        if body:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            calls[body.group(1)] = (computation, int(trips.group(1)) if trips else 1)
        for kind in KINDS:
            if _OP[kind].search(line):
                ops[computation][kind] += measure(line, kind)

    def trips(name: str) -> int:
        parent = calls.get(name)
        return 1 if parent is None else parent[1] * trips(parent[0])

    per_layer = {k: sum(ops[c][k] for c in ops if c in calls) for k in KINDS}
    per_step = {k: sum(ops[c][k] * trips(c) for c in ops) for k in KINDS}
    return per_layer, per_step


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def mesh_bench(
    variant: str, config: ModelConfig, mesh_text: str, *, batch: int, seq: int
) -> MeshResult:
    """Compile `config`'s training step on the mesh `mesh_text` ("fsdp=8") and measure it."""
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    shapes = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    shardings = param_shardings(shapes, mesh)
    model = _abstract(shapes, shardings)
    # make_optimizer reads the weight-decay mask from dtypes and ranks only: stand-ins suffice
    stand_ins = jax.tree.map(lambda x: jnp.zeros((1,) * len(x.shape), x.dtype), shapes)
    optimizer = make_optimizer(OptimSpec(), 1000, eqx.filter(stand_ins, eqx.is_inexact_array))
    trainable = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.inexact), shapes)
    params = eqx.filter(model, trainable)
    state = eqx.filter_eval_shape(optimizer.init, params)
    state = _abstract(state, shardings_like_params(state, params, eqx.filter(shardings, trainable)))
    step = TrainStep(optimizer, lambda _: 1e-3, param_shardings=shardings)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=batch_sharding(mesh))
    t0 = time.perf_counter()
    compiled = step.lower(model, state, tokens).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    per_layer, per_step = count_collectives(hlo)
    per_layer_bytes, per_step_bytes = collective_bytes(hlo)
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
        gathered_shapes=gathered_shapes(hlo),
    )


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in counts.items() if v) or "none"


def mesh_markdown(results: list[MeshResult]) -> str:
    """A markdown table: MiB per device and collectives per layer / per step."""
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    lines = [
        "| variant | mesh | arguments MiB | outputs MiB | temporaries MiB | total MiB "
        "| collectives per layer | collectives per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.variant} | {r.mesh} | {mib(r.argument_bytes)} | {mib(r.output_bytes)} | "
            f"{mib(r.temp_bytes)} | {mib(r.total_bytes)} | {_counts(r.per_layer)} | "
            f"{_counts(r.per_step)} |"
        )
    return "\n".join(lines)


MESH_NOTE = (
    "Memory per device from XLA's buffer assignment of the compiled step (total = arguments + "
    "outputs + temporaries - outputs written into donated arguments). Collectives counted in "
    "the optimised HLO: per layer = ops inside the layer loop's bodies (forward and backward), "
    "per step = every op times the trip count of the loops around it. The step is compiled, "
    "not run."
)
