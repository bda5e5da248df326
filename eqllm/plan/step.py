"""The training step `eqllm run` would run for a recipe, compiled for TPU devices from shapes.

`compile_recipe` builds what `eqllm.train.setup.start_run` builds (the recipe's model with its
dtypes, remat and adapters, its AdamW and schedule, the mesh, gradient accumulation, the
pipeline, donation) with every array a `jax.ShapeDtypeStruct`, compiles it with the TPU
compiler and reads what the compiler knows: memory per chip by part, FLOPs and bytes accessed,
and the collectives of the optimised program. An out-of-memory refusal is a result, not an
error.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqllm.bench.collectives import Collective, collectives
from eqllm.bench.hlo import Program
from eqllm.bench.mesh import AbstractState, abstract_state
from eqllm.config import ConfigError, ModelConfig
from eqllm.data import Tokenizer
from eqllm.model import CausalLM
from eqllm.plan.devices import PlanError
from eqllm.plan.kernels import GroupedCost, dispatch_block, grouped_cost, kernel_name
from eqllm.recipe import Recipe, RecipeError
from eqllm.sharding import batch_sharding, check_divisible, make_mesh
from eqllm.sharding.dispatch import experts_impl, experts_kernel
from eqllm.sharding.rules import RULES
from eqllm.train.mfu import step_flops
from eqllm.train.objectives import Instructions, LanguageModel
from eqllm.train.optim import schedule
from eqllm.train.setup import check_batch_split, pipeline_of, with_adapters
from eqllm.train.step import TrainStep
from eqllm.trees import param_count


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per chip: the parameters, optimizer state and batch the step takes (arguments),
    what it returns (outputs), its temporaries (activations, gradients, gathered weights) and
    the outputs written into donated arguments (aliased), from the compiler's buffer
    assignment; `peak` is the compiler's own peak of the program's HBM (`_hbm_peak`). `host`:
    what the step keeps in its host's memory instead (the layer inputs remat "offload" moves
    there), not in HBM."""

    params: int
    optimizer: int
    batch: int
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    peak: int
    host: int


@dataclasses.dataclass
class CompiledStep:
    """What the TPU compiler says about one recipe's step on one mesh (per chip).

    `refusal` holds the compiler's out-of-memory message when it refused the program (then
    `memory` is None); `needed` is the bytes it said the program needs, where it said so.
    FLOPs and bytes accessed are XLA's cost analysis scaled from one pass through each loop
    body to the loops' trip counts (`eqllm.bench.hlo.Program.loop_factor`), the grouped
    matmuls' kernels counted at their own trips (`step_cost`); `flops` and `bytes_accessed`
    are static bounds where those kernels get padded blocks, `run_flops` and `run_bytes` what
    their routed rows run.
    """

    compile_s: float
    mesh: dict[str, int]
    devices: list  # the mesh's devices in order: replica groups index them
    memory: Memory | None = None
    refusal: str = ""
    needed: int | None = None
    flops: float = 0.0  # the static bound: every grouped kernel over its whole block
    run_flops: float = 0.0  # the same with the grouped kernels over their routed rows only
    bytes_accessed: float = 0.0  # the static bound, as `flops`
    run_bytes: float = 0.0  # the same with the grouped kernels over their routed rows only
    xla_flops: float = 0.0
    xla_bytes: float = 0.0
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    hlo: str = ""  # the optimised program, as text
    model_flops: float = 0.0  # the model's FLOPs per step, all chips (eqllm.train.mfu)
    hardware_flops: float = 0.0  # the same with remat's recomputation
    # a mixture of experts' {"impl", "why", "requested"}: how the compiled step computes its
    # experts (`planned_config`), as a run's summary.json records it; None without experts
    experts: dict | None = None
    # the grouped matmuls' kernels: their FLOPs and bytes static and run (`eqllm.plan.kernels`)
    grouped: GroupedCost = dataclasses.field(default_factory=GroupedCost)


def _hbm_peak(memory) -> int:
    """The program's peak of HBM from the compiler's memory analysis. With buffers in the host's
    memory the TPU compiler's `peak_memory_in_bytes` is the larger of the device's peak and the
    arguments plus those host bytes: a 128-layer llama-nano on v5e-1 under remat "offload"
    reports its arguments plus 2 GiB of host bytes, to 18 KB, against 0.79 GB of device
    temporaries. Where it reads so, the device's own peak is not in the analysis and its bound
    stands for it: arguments, temporaries and the outputs not written into arguments."""
    peak, host = int(memory.peak_memory_in_bytes), int(memory.host_temp_size_in_bytes)
    arguments = int(memory.argument_size_in_bytes)
    if not host or abs(peak - arguments - host) > 2**20:
        return peak
    unaliased = int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes)
    return arguments + int(memory.temp_size_in_bytes) + unaliased


def model_config(recipe: Recipe) -> ModelConfig:
    """The model `eqllm run` builds for `recipe`: a model trained from scratch is sized to its
    tokenizer (the byte tokenizer's ids, or data.bpe_vocab_size for a BPE it trains); a
    published tokenizer is not downloaded to plan, so the variant's vocab_size stands for it."""
    tokenizer = recipe.data.tokenizer
    vocab = {"bytes": Tokenizer.bytes().vocab_size, "bpe": recipe.bpe_vocab_size()}.get(tokenizer)
    return recipe.model_config(vocab_size=vocab)


# The backend a plan compiles for: its moe.impl "auto" chooses for this, not for the host.
TARGET_BACKEND = "tpu"


def planned_config(recipe: Recipe, mesh) -> tuple[ModelConfig, dict | None]:
    """`model_config(recipe)` with its experts computed as `eqllm run` on the slice would
    compute them: moe.impl "auto" chosen for the TPU and `mesh` (the size of the axis that
    splits the experts, `eqllm.sharding.dispatch.experts_impl`), not for the host planning it,
    where it would choose dense experts on one device; an explicit moe.impl is kept; the
    grouped matmul is chosen for the TPU and `mesh` too (`experts_kernel`). With
    {"impl", "why", "requested", "kernel" (grouped impls)} for the plan's report (None without
    experts)."""
    config = model_config(recipe)
    choice = experts_impl(config, TARGET_BACKEND, mesh)
    if choice is None:
        return config, None
    impl, why = choice
    kernel = experts_kernel(config, TARGET_BACKEND, impl, mesh)
    experts = {"impl": impl, "why": why, "requested": config.moe.impl}
    if impl != "dense":  # the grouped matmul's kernel
        experts["kernel"] = kernel
    return config.replace(**{"moe.impl": impl, "moe.kernel": kernel}), experts


def lower_train_step(recipe: Recipe, mesh) -> tuple[jax.stages.Lowered, AbstractState, CausalLM]:
    """The recipe's training step on `mesh`, lowered from shapes (see the module docstring);
    with its abstract arguments and the model's shapes."""
    config, _ = planned_config(recipe, mesh)
    shapes = eqx.filter_eval_shape(
        lambda: with_adapters(recipe, CausalLM(config, key=jax.random.key(recipe.train.seed)))
    )
    total = recipe.total_steps(param_count(shapes))
    state = abstract_state(shapes, mesh, recipe.optim, total)
    step = TrainStep(
        state.optimizer,
        schedule(recipe.optim, total),
        objective=objective_of(recipe),
        grad_accum=recipe.train.grad_accum,
        param_shardings=state.shardings,
        batch_sharding=batch_sharding(mesh),
        dropout_seed=recipe.train.seed,
        pipeline=pipeline_of(recipe, mesh),
    )
    return step.lower(state.model, state.opt_state, abstract_batch(recipe, mesh)), state, shapes


# The objectives whose step compiles from the recipe alone: their batches are token windows
# (with a target mask for "sft"); the others need a reference model, a teacher or rollouts.
PLANNED_OBJECTIVES = ("lm", "sft")


def objective_of(recipe: Recipe) -> LanguageModel:
    """The objective `eqllm run` trains (`eqllm.train.objectives`), as its `start` builds it,
    without the data: the end-of-text id only marks where documents open, so any id compiles
    the same program, and packed instruction rows bring their own segments."""
    if recipe.train.objective == "sft":
        return Instructions(reset_positions=recipe.finetune.pack)
    document_token = 0 if recipe.data.document_mask else None
    return LanguageModel(document_token=document_token, reset_positions=recipe.data.reset_positions)


def abstract_batch(recipe: Recipe, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of the batch the objective's `batch(step)` gives the step, as the step places
    it (rows split over the mesh's data axes): "tokens", and for "sft" the targets' "mask" and,
    with finetune.pack, "segment_ids"."""
    rows, window = recipe.train.batch_size, recipe.data.seq_len + 1
    sharding = batch_sharding(mesh)
    batch = {"tokens": jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=sharding)}
    if recipe.train.objective == "sft":
        batch["mask"] = jax.ShapeDtypeStruct((rows, window - 1), jnp.bool_, sharding=sharding)
        if recipe.finetune.pack:
            segments = jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=sharding)
            batch["segment_ids"] = segments
    return batch


def check_recipe(recipe: Recipe, mesh) -> None:
    """Refuse, in one line each, what `eqllm run` would refuse on this mesh, before compiling."""
    objective = recipe.train.objective
    if objective not in PLANNED_OBJECTIVES:
        raise RecipeError(
            f"train.objective={objective!r}: eqllm plan compiles the language-model step "
            "(pretraining, continued pretraining, finetune.data); plan the same model with "
            "train.objective='lm'"
        )
    config = model_config(recipe)
    if config.attention.kernel == "cudnn":
        raise ConfigError(
            "attention.kernel='cudnn' cannot compile for TPU (cuDNN is NVIDIA's); set "
            "model.overrides.attention.kernel to 'xla' or 'auto'"
        )
    check_divisible(config, mesh)
    check_batch_split(recipe, mesh)
    pipeline = pipeline_of(recipe, mesh)
    if pipeline is not None:
        pipeline.check(config, recipe.train.batch_size // recipe.train.grad_accum)


def compile_recipe(recipe: Recipe, devices: list) -> CompiledStep:
    """Compile `recipe`'s step for `devices` (a TPU slice's, in order) and read it."""
    mesh = make_mesh(recipe.mesh, devices)
    check_recipe(recipe, mesh)
    try:
        lowered, state, shapes = lower_train_step(recipe, mesh)
    except jax.errors.JaxRuntimeError as e:
        raise _failed(recipe, "JAX's lowering", e) from e
    flops = step_flops(shapes, recipe.data.seq_len)
    tokens = recipe.train.batch_size * recipe.data.seq_len
    config, experts = planned_config(recipe, mesh)
    batch_split = math.prod(mesh.shape[a] for a in RULES["batch"])
    # Per accumulation step and pipeline microbatch: the rows one dispatch exchanges.
    steps = recipe.train.grad_accum * recipe.train.microbatches
    rows_per_chip = tokens // steps // batch_split
    result = CompiledStep(
        compile_s=0.0,
        mesh={k: int(v) for k, v in mesh.shape.items()},
        devices=list(mesh.devices.flat),
        model_flops=flops.model * tokens,
        hardware_flops=flops.hardware * tokens,
        experts=experts,
    )
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise _failed(recipe, "the TPU compiler", e) from e
        result.compile_s = time.perf_counter() - t0
        result.refusal = _refusal(str(e))
        result.needed = _needed_bytes(result.refusal)
        return result
    result.compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    result.memory = Memory(
        params=_per_chip(state.model),
        optimizer=_per_chip(state.opt_state),
        batch=_per_chip(abstract_batch(recipe, mesh)),
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        peak=_hbm_peak(memory),
        host=int(memory.host_temp_size_in_bytes),
    )
    result.hlo = compiled.as_text()
    program = Program(result.hlo)
    cost = compiled.cost_analysis() or {}
    result.xla_flops = float(cost.get("flops", 0.0))
    result.xla_bytes = float(cost.get("bytes accessed", 0.0))
    result.grouped = grouped_cost(program, dispatch_block(config, result.mesh, rows_per_chip))
    result.flops, result.run_flops, result.bytes_accessed, result.run_bytes = step_cost(
        result.xla_flops, result.xla_bytes, program, result.grouped
    )
    result.collectives = collectives(program)
    return result


def step_cost(
    xla_flops: float, xla_bytes: float, program: Program, grouped: GroupedCost
) -> tuple[float, float, float, float]:
    """(static FLOPs, run FLOPs, static bytes, run bytes) per chip per step. Static: XLA's cost
    analysis with its loop bodies at their trip counts (`Program.loop_factor`, read from the
    matrix products for FLOPs, from the unfused ops but the grouped kernels for bytes) and the
    grouped kernels at their own, each over its whole block; run: the same with the grouped
    kernels over their routed rows only (`eqllm.plan.kernels`)."""
    flops = (xla_flops - grouped.once) * program.loop_factor("flops") + grouped.static
    factor = program.loop_factor("bytes", skip=lambda i, t: kernel_name(i, t) is not None)
    moved = (xla_bytes - grouped.once_bytes) * factor + grouped.static_bytes
    return (
        flops,
        flops - grouped.static + grouped.run,
        moved,
        moved - grouped.static_bytes + grouped.run_bytes,
    )


def _failed(recipe: Recipe, stage: str, error: Exception) -> PlanError:
    """A runtime error of JAX or the TPU compiler while planning `recipe` (not out of memory,
    which is a finding), as one line naming the stage and the compiler's first line."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    mesh = recipe.mesh.describe()
    return PlanError(
        f"{recipe.name} on mesh {mesh}: the step failed in {stage}: {first}; try another mesh "
        "or kernel (model.overrides.moe.kernel, attention.kernel)"
    )


def _per_chip(tree) -> int:
    """Bytes one chip holds of a tree of ShapeDtypeStructs, by their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = getattr(leaf, "shape", None)
        if sharding is None or shape is None:
            continue
        total += math.prod(sharding.shard_shape(shape)) * np.dtype(leaf.dtype).itemsize
    return total


def _refusal(message: str) -> str:
    """The compiler's out-of-memory sentence, without the stack of buffers that follows it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = next((line for line in lines if "RESOURCE_EXHAUSTED" in line), lines[0])
    return first[first.index("RESOURCE_EXHAUSTED") :].rstrip(":. ")


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _needed_bytes(refusal: str) -> int | None:
    """The first size the refusal names (what the program needs), e.g. "(318.31G)"."""
    found = re.search(r"\(([\d.]+)([KMGT])\)?", refusal)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None
