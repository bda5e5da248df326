"""One plan: a recipe's training step compiled for a TPU slice, with the verdict and estimate.

`plan_recipe` compiles and reads the step (`eqllm.plan.step`), checks the compiler's peak
memory per chip against the chip's HBM, puts the analytic estimate of `eqllm.sharding.memory`
beside it and estimates the step's time (`eqllm.plan.roofline`). `recipe_for` reads a recipe,
or makes one for a bare zoo name with the defaults of large-scale training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eqllm import zoo
from eqllm.bench.collectives import tally
from eqllm.config import ConfigError
from eqllm.plan.devices import PlanError
from eqllm.plan.roofline import Roofline, estimate
from eqllm.plan.step import TARGET_BACKEND, CompiledStep, compile_recipe, model_config
from eqllm.recipe import Recipe, RecipeError, load_recipe, recipe_path
from eqllm.sharding import MeshConfig, MeshError, estimate_memory
from eqllm.sharding.tpu import TpuSlice

# The share of a chip's HBM a plan leaves free to be called a plan that fits with room.
HEADROOM = 0.10
ZOO_PREFIX = "zoo:"


@dataclasses.dataclass
class Plan:
    """A recipe's step compiled for `tpu`: the compiler's findings and the estimates."""

    recipe: Recipe
    tpu: TpuSlice
    step: CompiledStep
    estimated_bytes: int  # eqllm.sharding.memory's analytic total per chip
    roofline: Roofline | None  # None when the compiler refused the program

    @property
    def hbm(self) -> int:
        return self.tpu.chip.hbm_bytes

    @property
    def peak(self) -> int | None:
        """Bytes per chip at the program's peak: the compiler's own figure, or what its
        refusal said the program needs."""
        return self.step.memory.peak if self.step.memory else self.step.needed

    @property
    def fits(self) -> bool:
        return self.step.memory is not None and self.step.memory.peak <= self.hbm

    @property
    def headroom(self) -> float | None:
        """The share of HBM the compiled step leaves free (negative when it does not fit)."""
        return None if self.peak is None else 1 - self.peak / self.hbm

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.step.mesh.items() if v > 1) or "one chip"

    def to_dict(self) -> dict[str, Any]:
        """Plain values for --json and the experiment pages' results files."""
        t, s = self.recipe.train, self.step
        per_layer, per_step = tally(s.collectives, lambda c: 1)
        layer_bytes, step_bytes = tally(s.collectives, lambda c: c.result_bytes)
        r = self.roofline
        return {
            "recipe": self.recipe.name,
            "variant": self.recipe.model.variant,
            "topology": self.tpu.cloud_name,
            "jax_topology": self.tpu.jax_name,
            "slices": self.tpu.slices,
            "chips": self.tpu.chips,
            "mesh": s.mesh,
            "batch": t.batch_size,
            "seq": self.recipe.data.seq_len,
            "grad_accum": t.grad_accum,
            "microbatches": t.microbatches,
            "remat": t.remat,
            "precision": t.precision,
            "n_layers": model_config(self.recipe).n_layers,
            # a mixture of experts': how the step computes them, and why (moe.impl)
            "experts": s.experts,
            "compile_s": round(s.compile_s, 2),
            "fits": self.fits,
            "hbm_bytes": self.hbm,
            "peak_bytes": self.peak,
            "headroom": self.headroom,
            "refusal": s.refusal,
            "memory": dataclasses.asdict(s.memory) if s.memory else None,
            "estimated_bytes": self.estimated_bytes,
            "flops_per_chip": s.flops,  # the static bound (every grouped kernel's whole block)
            "run_flops_per_chip": s.run_flops,  # the grouped kernels over their routed rows
            "grouped_kernel_cost_per_chip": s.grouped.to_dict(),
            "bytes_accessed_per_chip": s.bytes_accessed,  # the static bound, as flops
            "run_bytes_accessed_per_chip": s.run_bytes,
            "xla_flops_per_chip": s.xla_flops,
            "xla_bytes_per_chip": s.xla_bytes,
            "model_flops": s.model_flops,
            "hardware_flops": s.hardware_flops,
            "collectives_per_step": per_step,
            "collectives_per_layer": per_layer,
            "collective_bytes_per_step": step_bytes,
            "collective_bytes_per_layer": layer_bytes,
            # of those bytes, the ops' that carry out another collective, by op and by that one
            "implemented_bytes_per_step": implemented(s.collectives),
            "roofline": None if r is None else r.to_dict(),
        }


def implemented(found: list) -> dict[str, dict[str, int]]:
    """Bytes per step of the ops that carry out another collective (a windowed einsum's ring of
    collective-permutes, an all-gather written as an all-reduce: `Collective.implements`), by
    op and by the collective they implement."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        if c.implements:
            by_op = out.setdefault(c.kind, {})
            by_op[c.implements] = by_op.get(c.implements, 0) + c.result_bytes * c.runs
    return out


def plan_recipe(recipe: Recipe, tpu: TpuSlice, devices: list) -> Plan:
    """Compile `recipe`'s step for `tpu` (whose devices are `devices`) and judge it."""
    step = compile_recipe(recipe, devices)
    config = model_config(recipe)
    t = recipe.train
    estimated = estimate_memory(
        config,
        step.mesh,
        batch_size=t.batch_size,
        seq_len=recipe.data.seq_len,
        grad_accum=t.grad_accum,
        microbatches=t.microbatches,
        backend=TARGET_BACKEND,
    ).total
    roofline = None
    if step.memory is not None:
        roofline = estimate(
            tpu,
            step.devices,
            step.mesh,
            step.collectives,
            flops=step.run_flops,
            bytes_accessed=step.run_bytes,
            model_flops=step.model_flops,
            offloaded=step.memory.host,
            grad_accum=t.grad_accum,
        )
    return Plan(recipe, tpu, step, estimated, roofline)


def recipe_for(name: str) -> tuple[Recipe, bool]:
    """(the recipe, whether it was made for a bare zoo model). `name` is a recipe (a path or a
    shipped name), or `zoo:NAME` (or a zoo name no recipe has) for a pretraining recipe of that
    model with the defaults of large-scale training: bf16 compute, fp32 parameters and AdamW
    state, no remat, FSDP over every chip, the model's own vocabulary (its published
    tokenizer) and sequences of up to 4,096 tokens; one sequence per chip unless --batch."""
    bare = name.removeprefix(ZOO_PREFIX)
    if not name.startswith(ZOO_PREFIX):
        try:
            return load_recipe(recipe_path(name)), False
        except RecipeError:
            if bare not in zoo.names():
                raise
    try:
        entry = zoo.entry(bare)
    except ConfigError as e:
        raise PlanError(f"{name!r} is neither a recipe nor a zoo model: {e}") from None
    cfg = entry.config
    data: dict[str, Any] = {"seq_len": min(cfg.max_seq_len, 4096)}
    data |= {"tokenizer": entry.source} if entry.source else {"bpe_vocab_size": cfg.vocab_size}
    recipe = Recipe.from_dict(
        {
            "name": bare,
            "description": f"{bare} pretraining, as planned by eqllm plan",
            "model": {"variant": bare, "overrides": {"vocab_size": cfg.vocab_size}},
            "data": data,
            "train": {"batch_size": 1, "tokens_per_param": 20.0, "precision": "bfloat16"},
            "mesh": {"data": 1, "fsdp": -1},
        }
    )
    return recipe, True


def with_settings(recipe: Recipe, **settings: Any) -> Recipe:
    """`recipe` with the plan's settings (None: keep the recipe's): mesh (a MeshConfig),
    batch, seq, remat, grad_accum, microbatches, precision, topology, slices."""
    paths = {
        "batch": "train.batch_size",
        "seq": "data.seq_len",
        "remat": "train.remat",
        "grad_accum": "train.grad_accum",
        "microbatches": "train.microbatches",
        "precision": "train.precision",
        "topology": "plan.topology",
        "slices": "plan.slices",
    }
    values = recipe.to_dict()
    for key, value in settings.items():
        if value is None:
            continue
        if key == "mesh":
            values["mesh"] = value.axis_sizes()
            continue
        section, field = paths[key].split(".")
        values.setdefault(section, {})[field] = value
    return Recipe.from_dict(values)


def parse_mesh(text: str) -> MeshConfig:
    """--mesh "data=2,fsdp=4,tensor=2": eqllm's axes; `expert=` is refused by name."""
    if any(part.strip().startswith("expert") for part in text.split(",")):
        raise MeshError(
            f"--mesh {text}: eqllm has no expert axis; a mixture of experts' experts are split "
            "over the fsdp axis (expert parallelism where moving the tokens costs fewer bytes "
            "than gathering the experts), so write fsdp=N"
        )
    return MeshConfig.parse(text)
