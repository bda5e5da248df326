"""What `eqllm plan` prints: one plan in lines, a search as a ranked table."""

from __future__ import annotations

from eqllm.bench.collectives import KINDS, tally
from eqllm.plan.plan import HEADROOM, Plan, implemented
from eqllm.plan.search import Search
from eqllm.sharding import human_bytes

GiB = 2**30


def _gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GiB:,.2f}"


def _size(n: int | float | None) -> str:
    return "?" if n is None else human_bytes(n)


def verdict(plan: Plan) -> str:
    if plan.step.refusal:
        return f"does not fit: the TPU compiler refused it: {plan.step.refusal}"
    if not plan.fits:
        return f"does not fit: peak {_size(plan.peak)} per chip"
    return f"fits, {plan.headroom:.0%} of HBM free"


def describe(plan: Plan) -> str:
    """One plan, in lines: the step, the compiler's memory, FLOPs, collectives, the estimate."""
    r, s, t = plan.recipe, plan.step, plan.recipe.train
    lines = [
        f"{r.name} ({r.model.variant}) on {plan.tpu.describe()}, mesh {plan.mesh_text}: "
        f"{verdict(plan)}",
        f"  step: batch {t.batch_size} x {r.data.seq_len} tokens, grad_accum {t.grad_accum}"
        + (f", {t.microbatches} pipeline microbatches" if t.microbatches > 1 else "")
        + f", {t.precision} compute, float32 parameters and AdamW state, remat {t.remat}",
        f"  compiled in {s.compile_s:.1f} s",
    ]
    if s.experts is not None:
        lines.insert(2, f"  experts: moe.impl {s.experts['impl']} ({s.experts['why']})")
    estimate = f"eqllm.sharding.memory estimates {_size(plan.estimated_bytes)}"
    if s.memory is None:
        needed = f"; it needs {_size(s.needed)}" if s.needed else ""
        lines.append(f"  memory per chip (HBM {_size(plan.hbm)}){needed}; {estimate}")
        return "\n".join(lines)
    m = s.memory
    lines += [
        f"  memory per chip (HBM {_size(plan.hbm)}): parameters {_size(m.params)}, "
        f"optimizer state {_size(m.optimizer)}, batch {_size(m.batch)}, temporaries "
        f"{_size(m.temporaries)}, outputs {_size(m.outputs)} ({_size(m.aliased)} of them "
        f"written into donated arguments); peak {_size(m.peak)}"
        + (f"; offloaded to the host's memory {_size(m.host)}" if m.host else ""),
        f"    {estimate} ({plan.estimated_bytes / m.peak:.2f}x the compiler's peak)",
        *flops_lines(plan),
        "  bytes accessed per chip per step: "
        + (
            f"{s.bytes_accessed:.3g}"
            if s.run_bytes == s.bytes_accessed
            else f"{s.run_bytes:.3g} run, {s.bytes_accessed:.3g} compiled (a static bound)"
        ),
        f"  collectives per step: {collectives_text(plan)}",
    ]
    per_layer, _ = tally(s.collectives, lambda c: 1)
    if any(per_layer.values()):
        lines.append(f"    per layer loop pass: {_counts(per_layer)}")
    lines.append(f"  roofline: {roofline_text(plan)}")
    return "\n".join(lines)


def flops_lines(plan: Plan) -> list[str]:
    """FLOPs per chip per step: the compiled static count against the model's, and where
    grouped kernels pad their blocks, what they run (`eqllm.plan.kernels`)."""
    s = plan.step
    model = s.model_flops / plan.tpu.chips
    hardware = s.hardware_flops / plan.tpu.chips
    remat = (
        f", {_ratio(s.run_flops, hardware)}x with remat's recomputation"
        if hardware != model
        else ""
    )
    if s.run_flops == s.flops:
        return [
            f"  FLOPs per chip per step: {s.flops:.3g} compiled (XLA's count, loops at their trip "
            f"counts), {model:.3g} by the model (the compiled step does "
            f"{_ratio(s.flops, model)}x{remat})"
        ]
    g = s.grouped
    return [
        f"  FLOPs per chip per step: {s.run_flops:.3g} run, {model:.3g} by the model (the step "
        f"runs {_ratio(s.run_flops, model)}x{remat}); {s.flops:.3g} compiled, a static bound "
        f"({_ratio(s.flops, model)}x)",
        f"    grouped-matmul kernels: {g.static:.3g} by their cost estimates, over every row of "
        f"their blocks ({g.block:,} rows), {g.run:.3g} over the {g.routed:,} routed copies a "
        "chip runs on average (the kernels skip row tiles no expert's rows reach)",
    ]


def collectives_text(plan: Plan) -> str:
    _, counts = tally(plan.step.collectives, lambda c: 1)
    _, sizes = tally(plan.step.collectives, lambda c: c.result_bytes)
    parts = [f"{k} {counts[k]:,} ({_size(sizes[k])})" for k in KINDS if counts[k]]
    text = ", ".join(parts) or "none"
    for op, kinds in implemented(plan.step.collectives).items():
        done = ", ".join(f"{_size(n)} of {kind}s" for kind, n in kinds.items())
        text += f"; the {op}s carry out {done}"
    between = [c for c in plan.step.collectives if c.dcn]
    if between:
        sent = sum(c.result_bytes * c.runs for c in between)
        runs = sum(c.runs for c in between)
        text += f"; of them between slices (sent over DCN): {runs:,} ({_size(sent)})"
    return text


def roofline_text(plan: Plan) -> str:
    q = plan.roofline
    if q is None:
        return "none (not compiled)"
    axes = ", ".join(f"{a} {s:.3g} s" for a, s in sorted(q.comm_by_axes.items()))
    return (
        f"compute {q.compute_s:.3g} s, HBM {q.memory_s:.3g} s, ICI {q.ici_s:.3g} s"
        + (f" ({axes})" if axes else "")
        + f", DCN {q.dcn_s:.3g} s"
        + (f", host link {q.host_s:.3g} s" if q.host_s else "")
        + f": step >= {q.step_s:.3g} s ({q.bound}-bound); "
        f"MFU <= {q.mfu:.1%} (an upper bound; {q.mfu_serial:.1%} with nothing overlapped)"
    )


def search_table(found: Search, uncompiled: int = 5) -> str:
    """The compiled plans ranked by their roofline MFU, with the estimate's view of each, then
    the next `uncompiled` candidates by estimate (what --max-compiles would compile next)."""
    rows = [
        "| rank | mesh | remat | grad_accum | estimate GiB | peak GiB | headroom | step s | "
        "MFU <= | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(found.plans, key=lambda p: -(p.roofline.mfu if p.roofline else -1))
    for i, p in enumerate(ranked, 1):
        t, q = p.recipe.train, p.roofline
        micro = f" x{t.microbatches}mb" if t.microbatches > 1 else ""
        headroom = "-" if p.headroom is None else f"{p.headroom:.0%}"
        rows.append(
            f"| {i} | {p.mesh_text} | {t.remat} | {t.grad_accum}{micro} | "
            f"{_gib(p.estimated_bytes)} | {_gib(p.peak)} | {headroom} | "
            f"{'-' if q is None else f'{q.step_s:.3g}'} | "
            f"{'-' if q is None else f'{q.mfu:.1%}'} | {p.step.compile_s:.0f} |"
        )
    for c in found.candidates[len(found.plans) : len(found.plans) + uncompiled]:
        micro = f" x{c.microbatches}mb" if c.microbatches > 1 else ""
        mesh = c.mesh.describe().replace("pipeline=1,", "")
        rows.append(
            f"| - | {mesh} | {c.remat} | {c.grad_accum}{micro} | {_gib(c.estimated_bytes)} | "
            f"not compiled | - | {c.estimated_s:.3g} (analytic) | - | - |"
        )
    return "\n".join(rows)


def search_summary(found: Search) -> str:
    head = (
        f"--mesh auto on {found.tpu.describe()}: {found.considered} meshes x remats x "
        f"accumulations estimated, {len(found.candidates)} fit by the estimate, "
        f"{len(found.plans)} compiled in {found.seconds:.0f} s"
    )
    if found.best is None:
        return (
            f"{head}\nno compiled plan leaves {HEADROOM:.0%} of HBM free; try a larger slice, "
            "more gradient accumulation or --max-compiles"
        )
    return f"{head}\nbest plan with at least {HEADROOM:.0%} of HBM free:\n{describe(found.best)}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items() if v) or "none"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "?"
