"""`--mesh auto`: the fastest plan that fits, found by estimate first and compiler second.

The candidates are every split of the chips over the axes the model allows (tensor where it
divides the heads and hidden units, up to 8; pipeline where the stages can run the layers
(`eqllm.train.stages.check_stages`: mixtures of experts too, after a dense prefix), up to
8, with 1, 2 or 4 microbatches per stage; fsdp where it divides d_model; data the rest; a
mixture of experts' experts go with fsdp), every remat policy and every gradient
accumulation that leaves each micro-batch split over data x fsdp. `eqllm.sharding.memory`'s
estimate drops those that cannot fit with HEADROOM left; the rest are ordered by an analytic
step time (compute at peak, FSDP gathers and reduce-scatters, data-parallel gradient
all-reduce, tensor-parallel activation all-reduces over the links, the pipeline bubble), and
the best few are compiled, in that order, until the count or time bound is reached. The
compiled plans are ranked by their roofline MFU; the best one with `HEADROOM` of HBM left is
the answer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable

import equinox as eqx
import jax

from eqllm import zoo
from eqllm.config import ModelConfig
from eqllm.model import CausalLM
from eqllm.plan.devices import PlanError
from eqllm.plan.plan import HEADROOM, Plan, plan_recipe, with_settings
from eqllm.plan.step import TARGET_BACKEND, model_config
from eqllm.recipe import Recipe
from eqllm.sharding import MeshConfig, MeshError, check_divisible, estimate_memory
from eqllm.sharding.memory import offloaded_bytes
from eqllm.sharding.tpu import TpuSlice, parse_slice
from eqllm.train.mfu import step_flops
from eqllm.train.stages import check_stages

REMATS = ("none", "dots_no_batch", "dots", "full", "offload")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search, with its analytic memory (bytes per chip) and step time."""

    mesh: MeshConfig
    remat: str
    grad_accum: int
    microbatches: int
    estimated_bytes: int
    estimated_s: float
    comm_s: float  # the analytic communication part of it: collectives and the host link

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        mesh = self.mesh.describe().replace("pipeline=1,", "").replace(",tensor=1", "")
        return f"{mesh} remat={self.remat} grad_accum={self.grad_accum}" + (
            f" microbatches={self.microbatches}" if self.microbatches > 1 else ""
        )


@dataclasses.dataclass
class Search:
    """What `search` did: the candidates by estimate, the compiled plans, the chosen one."""

    tpu: TpuSlice
    considered: int  # splits x remats x accumulations tried by estimate
    candidates: list[Candidate]  # those the estimate says fit, fastest first
    plans: list[Plan]  # compiled, in the order compiled
    seconds: float
    best: Plan | None


def candidates(recipe: Recipe, tpu: TpuSlice) -> tuple[int, list[Candidate]]:
    """(how many points were tried, those whose estimate leaves the chip HEADROOM, fastest
    first). Only such a plan can be the answer, so a tighter one is not worth a compile:
    mixtral-8x7b on v6e-256 once spent all three compiles on plans of 8% headroom."""
    config = model_config(recipe)
    batch, seq = recipe.train.batch_size, recipe.data.seq_len
    limit = tpu.chip.hbm_bytes * (1 - HEADROOM)
    tried, found = 0, []
    for sizes in _splits(config, tpu.chips):
        pipeline, data, fsdp, tensor = sizes
        split = data * fsdp
        for remat, grad_accum in itertools.product(REMATS, _divisors(batch)):
            for microbatches in (1,) if pipeline == 1 else (pipeline, 2 * pipeline, 4 * pipeline):
                rows = batch // grad_accum
                if batch % grad_accum or rows % microbatches or (rows // microbatches) % split:
                    continue
                tried += 1
                mesh = MeshConfig(pipeline, data, fsdp, tensor)
                axes = dict(zip(("pipeline", "data", "fsdp", "tensor"), sizes, strict=True))
                total = estimate_memory(
                    config.replace(remat=remat),
                    axes,
                    batch_size=batch,
                    seq_len=seq,
                    grad_accum=grad_accum,
                    microbatches=microbatches,
                    backend=TARGET_BACKEND,
                ).total
                if total > limit:
                    continue
                compute, comm, host = _step_time(
                    config, remat, axes, grad_accum, microbatches, batch, seq, tpu
                )
                step = max(compute, comm, host)
                found.append(
                    Candidate(mesh, remat, grad_accum, microbatches, total, step, comm + host)
                )
    found.sort(key=lambda c: (c.estimated_s, c.comm_s, c.estimated_bytes))
    return tried, found


def search(
    recipe: Recipe,
    tpu: TpuSlice,
    devices: list,
    *,
    max_compiles: int = 4,
    time_limit: float = 1800.0,
    log: Callable[[str], None] = lambda s: None,
) -> Search:
    """Compile the best `max_compiles` candidates by estimate (starting no compile after
    `time_limit` seconds) and choose the fastest that fits with HEADROOM; PlanError when the
    estimate finds nothing that fits, naming the slice it says would."""
    t0 = time.perf_counter()
    tried, found = candidates(recipe, tpu)
    if not found:
        raise PlanError(nothing_fits(recipe, tpu, tried))
    plans = []
    for candidate in found[:max_compiles]:
        if plans and time.perf_counter() - t0 > time_limit:
            log(f"time limit of {time_limit:.0f} s reached after {len(plans)} compiles")
            break
        settings = with_settings(
            recipe,
            mesh=candidate.mesh,
            remat=candidate.remat,
            grad_accum=candidate.grad_accum,
            microbatches=candidate.microbatches,
            topology=tpu.cloud_name,
            slices=tpu.slices,
        )
        gib = candidate.estimated_bytes / 2**30
        log(f"compiling {candidate.describe()} (estimate {gib:.1f} GiB per chip)")
        plan = plan_recipe(settings, tpu, devices)
        plans.append(plan)
        verdict = f"peak {plan.peak / 2**30:.1f} GiB" if plan.peak else "refused"
        log(f"  compiled in {plan.step.compile_s:.0f} s: {verdict}")
    roomy = [p for p in plans if p.fits and p.headroom >= HEADROOM and p.roofline is not None]
    best = max(roomy, key=lambda p: p.roofline.mfu, default=None)
    return Search(tpu, tried, found, plans, time.perf_counter() - t0, best)


def nothing_fits(recipe: Recipe, tpu: TpuSlice, tried: int) -> str:
    """The "nothing fits" message: what the smallest estimate needs, and the smallest slice of
    the same chip where the estimate finds a plan."""
    name = recipe.model.variant
    count = zoo.human_count(zoo.param_count(model_config(recipe)))
    text = (
        f"nothing fits: no plan of {name} ({count} parameters, batch {recipe.train.batch_size} "
        f"x {recipe.data.seq_len}) fits {tpu.describe()} with {tpu.chip.hbm_bytes / 2**30:.0f} "
        f"GiB per chip and {HEADROOM:.0%} of it free ({tried} meshes, remats and accumulations "
        "estimated)"
    )
    chips = tpu.chips
    for count in sorted(c for c in _slice_sizes(tpu) if c > chips):
        bigger = parse_slice(f"{tpu.chip.name}-{count * tpu.chip.cores_per_chip}")
        batch = max(recipe.train.batch_size, bigger.chips)
        scaled = with_settings(recipe, batch=batch) if batch != recipe.train.batch_size else recipe
        _, fit = candidates(scaled, bigger)
        if fit:
            at = f" at batch {batch}" if batch != recipe.train.batch_size else ""
            plan = f"{fit[0].describe()}{at}"
            return f"{text}; the estimate says {bigger.describe()} would fit ({plan})"
    return f"{text}; the estimate finds no {tpu.chip.name} slice that would"


def _slice_sizes(tpu: TpuSlice) -> list[int]:
    sizes = []
    for n in range(1, tpu.chip.max_chips + 1):
        try:
            sizes.append(parse_slice(f"{tpu.chip.name}-{n * tpu.chip.cores_per_chip}").chips)
        except Exception:
            continue
    return sizes


def _splits(config: ModelConfig, chips: int):
    """(pipeline, data, fsdp, tensor) over `chips` that the model's dimensions allow."""
    divisors = [d for d in range(1, chips + 1) if chips % d == 0]
    for tensor, pipeline in itertools.product(divisors, divisors):
        if tensor > 8 or pipeline > 8 or chips % (tensor * pipeline):
            continue
        if pipeline > 1:
            try:  # the stages run one stack alike, after a dense prefix (experts included)
                check_stages(config, pipeline)
            except MeshError:
                continue
        rest = chips // (tensor * pipeline)
        for fsdp in (d for d in divisors if rest % d == 0):
            sizes = {"pipeline": pipeline, "data": rest // fsdp, "fsdp": fsdp, "tensor": tensor}
            try:
                check_divisible(config, sizes)
            except MeshError:
                continue
            yield pipeline, rest // fsdp, fsdp, tensor


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _step_time(config, remat, axes, grad_accum, microbatches, batch, seq, tpu):
    """Analytic (compute, communication, host link) seconds per step on `tpu`: compute at peak
    (with remat's recomputation and the pipeline's bubble), the collectives over the links and
    what remat "offload" moves to the host's memory and back."""
    chip = tpu.chip
    flops = step_flops(_shapes(config.replace(remat=remat)), seq).hardware * batch * seq
    stages = axes["pipeline"]
    bubble = (microbatches + stages - 1) / microbatches
    compute = flops / tpu.chips / chip.peak_flops * bubble
    weights = 2 * zoo.param_count(config) / (axes["tensor"] * stages)  # bf16, per replica
    link = 2 * chip.ici_link  # a ring along one dimension, both ways
    f, d, t = axes["fsdp"], axes["data"], axes["tensor"]
    comm = 0.0
    if f > 1:  # each micro-batch gathers the weights twice and reduce-scatters the gradient
        comm += grad_accum * 3 * weights * (f - 1) / f / (link * chip.torus_dims)
    if d > 1:  # the gradient, all-reduced once per step
        comm += 2 * 2 * weights / f * (d - 1) / d / link
    if t > 1:  # 4 all-reduces of each layer's activations per micro-batch
        tokens = batch * seq / (d * f)
        comm += 4 * config.n_layers * 2 * 2 * tokens * config.d_model * (t - 1) / t / link
    offloaded = offloaded_bytes(config.replace(remat=remat), axes, batch_size=batch, seq_len=seq)
    return compute, comm, offloaded / chip.host_link


@functools.lru_cache(maxsize=16)
def _shapes(config: ModelConfig) -> CausalLM:
    """The model's shapes (what `step_flops` reads), once per config a search asks about."""
    return eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
