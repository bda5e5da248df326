"""The words and tables of docs/experiments/at_scale.md, written from at_scale.json alone."""

from __future__ import annotations

GiB = 2**30


SECTIONS = {
    "recipes": "the recipe table",
    "sizes": "the published sizes",
    "chips": "chip count",
    "depth": "depth",
    "auto": "`--mesh auto`",
    "maxtext": "MaxText's configurations",
}


def page(results: dict, command: str, maxtext: list, planned: list[dict]) -> str:
    """The page; `planned` is every point the script defines (id and section), so that the
    page says which sections have not run yet rather than showing them empty."""
    points = results["points"]
    m = results["machine"]
    done = [r for r in points.values() if "result" in r]
    missing = [pt for pt in planned if pt["id"] not in points]
    todo = {s: sum(pt["section"] == s for pt in missing) for s in SECTIONS}
    left = ", ".join(f"{SECTIONS[s]} ({n})" for s, n in todo.items() if n)
    hours = sum(r["wall_s"] for r in points.values()) / 3600
    dates = sorted(r["date"] for r in points.values())
    out = [
        "# The zoo at scale, from the TPU compiler",
        "",
        "Every figure on this page comes from the real TPU compiler (libtpu), run on a machine "
        "with no TPU: `eqllm plan` compiles the training step `eqllm run` would run, from shapes "
        "alone, for the named slice, and reads the compiler's memory analysis, its cost analysis "
        "and the optimised program's collectives; the step times and MFU are its roofline "
        "estimate, an upper bound ([plan.md](../plan.md) says how each is made). Nothing here "
        "ran on a TPU.",
        "",
        f"Regenerate: `{command}` (it resumes where it stopped; `--only recipes` prints the "
        "recipe table). Each point is one `eqllm plan ... --json` process, run one at a time "
        f"under `nice`; the whole page took {hours:.1f} hours of wall time on this machine "
        f"({m.get('cores')} cores, {m.get('memory_gib')} GiB, shared with other jobs: the "
        "compile times below are inflated by that load, listed per point in at_scale.json), "
        f"{len(done)} of {len(points)} points compiled, between {dates[0] if dates else '-'} "
        f"and {dates[-1] if dates else '-'}. jax {m.get('jax')}, libtpu {m.get('libtpu')}.",
        "",
    ]
    out += [f"- commit: {_commits(points)}", ""]
    if left:
        out += [
            f"{len(points)} of the script's {len(planned)} points have run; a section appears "
            f"here once its points have. Not run yet: {left}.",
            "",
        ]
    out += _recipes(points)
    out += _sizes(points)
    out += _chips(points)
    out += _depth(points)
    out += _auto(points)
    out += _maxtext(points, maxtext)
    out += _failures(points)
    return "\n".join(out).rstrip() + "\n"


def _commits(points: dict) -> str:
    """The code each point compiled at (at_scale.json's `commit`), and the code that re-read
    its program (`reanalyzed_at`, `--reanalyze`) where that differs."""
    compiled = sorted({r["commit"] for r in points.values() if r.get("commit")})
    read = sorted({r["reanalyzed_at"] for r in points.values() if r.get("reanalyzed_at")})
    names = lambda commits: ", ".join(f"`{c}`" for c in commits)  # noqa: E731
    text = f"{names(compiled) or 'unknown'} (the points compiled at "
    text += "it)" if len(compiled) == 1 else "them)"
    if read and read != compiled:
        text += f"; their programs re-read with the HLO reader of {names(read)}"
    return text


def best(row: dict | None) -> dict | None:
    """The plan of a point: its only plan, or the search's best (else its first)."""
    if row is None or "result" not in row:
        return None
    result = row["result"]
    if "search" in result:
        return result["best"] or (result["search"][0] if result["search"] else None)
    return result


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:,.1f}"


def _mesh(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1) or "one chip"


def _mfu(p: dict) -> str:
    r = p.get("roofline")
    return "-" if not r else f"{r['mfu']:.0%}"


def _headroom(p: dict) -> str:
    return "-" if p["headroom"] is None else f"{p['headroom']:.0%}"


def _fits(p: dict) -> str:
    if p["refusal"]:
        return "**no** (compiler: out of memory)"
    return "yes" if p["fits"] else "**no**"


def semantic(p: dict) -> dict[str, tuple[float, str]]:
    """GiB per step by the collective carried out, with the op that carried it out where the
    compiler wrote it as another (a windowed einsum's permutes, an all-reduce of a zero-filled
    buffer)."""
    out = {k: [v, ""] for k, v in p["collective_bytes_per_step"].items()}
    for op, kinds in p.get("implemented_bytes_per_step", {}).items():
        for kind, n in kinds.items():
            out[op][0] -= n
            out[kind][0] += n
            out[kind][1] = f"as {op}s" if not out[kind][1] else out[kind][1] + f" and {op}s"
    return {k: (v / GiB, how) for k, (v, how) in out.items()}


def _kind_bytes(p: dict) -> str:
    parts = [
        f"{k} {g:,.1f}" + (f" ({how})" if how else "")
        for k, (g, how) in semantic(p).items()
        if g >= 0.01
    ]
    return ", ".join(parts) or "none"


def _dominant(p: dict) -> str:
    by_kind = semantic(p)
    kind = max(by_kind, key=lambda k: by_kind[k][0])
    return "-" if by_kind[kind][0] < 0.01 else kind


def _recipes(points: dict) -> list[str]:
    rows = [(k.split(":", 1)[1], best(r), r) for k, r in points.items() if k.startswith("recipe:")]
    if not rows:
        return []
    out = [
        "## The recipes on their slices",
        "",
        "Every recipe of a published model of a billion parameters or more, compiled on the slice "
        "its `[plan]` table names, with its own batch, sequence length, mesh and remat "
        "(`eqllm plan RECIPE`). Peak is the compiler's, per chip, against the chip's HBM; the "
        "MFU is the roofline's upper bound; host is the compiling process's peak memory here.",
        "",
        "| recipe | slice (chips) | mesh | batch x seq (accum) | fits | peak GiB / HBM | headroom "
        "| est. MFU <= | bound | compile s | host GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p, row in sorted(rows, key=lambda t: (t[1] or {}).get("chips", 0)):
        if p is None:
            out.append(f"| {name} | | | | not compiled: {row.get('error')} | | | | | | |")
            continue
        r = p.get("roofline") or {}
        out.append(
            f"| {name} | {p['topology']} ({p['chips']}) | {_mesh(p)} | {p['batch']} x {p['seq']} "
            f"({p['grad_accum']}) | {_fits(p)} | {_gib(p['peak_bytes'])} / "
            f"{_gib(p['hbm_bytes'])} | {_headroom(p)} | {_mfu(p)} | {r.get('bound', '-')} | "
            f"{p['compile_s']:.0f} | {_gib(row.get('peak_rss_bytes'))} |"
        )
    done = [(name, p) for name, p, _ in rows if p is not None]
    fit = [(p["headroom"], name) for name, p in done if p["fits"] and p["headroom"] is not None]
    summary = f"{len(fit)} of the {len(done)} compiled recipes fit their slices"
    if fit:
        least, name = min(fit)
        summary += f"; the least headroom is {least:.0%} ({name})"
    return out + ["", summary + ".", ""]


def _sizes(points: dict) -> list[str]:
    rows = []
    for key, row in points.items():
        p = best(row)
        if p is not None and (key.startswith("size:") or key.startswith("recipe:")):
            rows.append((key.split(":", 1)[1], p))
    if not rows:
        return []
    out = [
        "## Published sizes, from 124M to DeepSeek-V3",
        "",
        "The same points as the recipe table (the sizes below a billion parameters with the zoo "
        "defaults on the smallest v5p slice), by part: per chip, the parameters and AdamW state "
        "the mesh leaves on a chip, the temporaries (activations, gradients, gathered weights), "
        "the bytes the step's collectives move, by kind, and the roofline's step time.",
        "",
        "| model | slice | mesh | params GiB | optimizer GiB | temporaries GiB | collective GiB "
        "per step (by kind) | step s >= | est. MFU <= | compiled / model FLOPs | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in sorted(rows, key=lambda t: t[1]["model_flops"] / t[1]["batch"]):
        mem = p["memory"] or {}
        r = p.get("roofline") or {}
        run = p.get("run_flops_per_chip") or p["flops_per_chip"]  # grouped kernels: routed rows
        flops = run * p["chips"] / p["model_flops"] if run else 0
        out.append(
            f"| {name} | {p['topology']} | {_mesh(p)} | {_gib(mem.get('params'))} | "
            f"{_gib(mem.get('optimizer'))} | {_gib(mem.get('temporaries'))} | {_kind_bytes(p)} | "
            f"{r.get('step_s', 0):.3g} | {_mfu(p)} | {flops:.2f} | {p['compile_s']:.0f} |"
        )
    return out + [""]


def _chips(points: dict) -> list[str]:
    rows = [(int(k.split(":")[1]), best(r), r) for k, r in points.items() if k.startswith("chips:")]
    if not rows:
        return []
    out = [
        "## One model from 8 to 1,024 chips",
        "",
        "llama3-8b on v5p slices, FSDP over every chip, one 4,096-token sequence per chip (so "
        "the global batch grows with the chips), remat full: "
        "`eqllm plan zoo:llama3-8b --topology v5p-{2 x chips} --mesh fsdp={chips} --batch {chips} "
        "--seq 4096 --remat full`.",
        "",
        "| chips | compile s | host GiB | params + optimizer GiB | temporaries GiB | peak GiB | "
        "collective GiB per step (by kind) | dominant | ICI s | step s >= | est. MFU <= |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    done = [(chips, p, row) for chips, p, row in sorted(rows, key=lambda t: t[0]) if p]
    for chips, p, row in sorted(rows, key=lambda t: t[0]):
        if p is None:
            out.append(f"| {chips} | not compiled: {row.get('error')} | | | | | | | | | |")
            continue
        mem = p["memory"] or {}
        r = p.get("roofline") or {}
        state = (mem.get("params") or 0) + (mem.get("optimizer") or 0)
        out.append(
            f"| {chips} | {p['compile_s']:.0f} | {_gib(row.get('peak_rss_bytes'))} | "
            f"{_gib(state)} | {_gib(mem.get('temporaries'))} | {_gib(p['peak_bytes'])} | "
            f"{_kind_bytes(p)} | {_dominant(p)} | {r.get('ici_s', 0):.3g} | "
            f"{r.get('step_s', 0):.3g} | {_mfu(p)} |"
        )
    if len(done) > 1:
        out += ["", *_chips_words(done)]
    return out + [""]


def _chips_words(done: list) -> list[str]:
    """What the chip-count table shows, in words, from its figures."""
    lo, hi = done[0][0], done[-1][0]
    compile_s = [p["compile_s"] for _, p, _ in done]
    state = [((p["memory"]["params"] + p["memory"]["optimizer"]) / GiB) for _, p, _ in done]
    temps = [p["memory"]["temporaries"] / GiB for _, p, _ in done]
    gathers = [semantic(p)["all-gather"][0] for _, p, _ in done]
    by_kind = [semantic(p) for _, p, _ in done]
    reductions = [k["reduce-scatter"][0] + k["all-reduce"][0] for k in by_kind]
    how = {c: semantic(p)["all-gather"][1] or "as all-gathers" for c, p, _ in done}
    written = "; ".join(
        f"{', '.join(str(c) for c in how if how[c] == way)} chips: {way}"
        for way in dict.fromkeys(how.values())
    )
    steps = [p["roofline"]["step_s"] for _, p, _ in done]
    return [
        f"**Compile time** stays between {min(compile_s):.0f} and {max(compile_s):.0f} s from "
        f"{lo} to {hi} chips: the compiler partitions one program for one chip, whose size "
        "does not grow with the count (the spread follows this machine's load, not the "
        "slice). **Memory**: the parameters and AdamW state a chip holds fall as 1/chips "
        f"({state[0]:.1f} GiB at {lo} chips, {state[-1]:.2f} at {hi}), while the temporaries "
        f"stay between {min(temps):.1f} and {max(temps):.1f} GiB: one sequence per chip, one "
        "layer's gathered weights at a time.",
        "",
        "**Which collective dominates, and why.** The weights' all-gather, at every count: "
        f"{_span(gathers)} GiB per chip per step, each layer's bf16 weights gathered for the "
        "forward pass and again for the backward (remat full recomputes the forward from "
        "them), ahead of the gradients' reduction to each chip's shard (reduce-scatter, or "
        f"all-reduce and slice: {_span(reductions)} GiB). FSDP moves the whole model through "
        "every chip each step however many chips share it, and each chip's compute is fixed by "
        "its one sequence, so communication per chip neither grows nor shrinks with the slice; "
        f"the roofline's step stays at {min(steps):.3g}-{max(steps):.3g} s, compute-bound. What "
        f"changes is how the compiler writes the gathers ({written}) and the reduce-scatters "
        "(rings of collective-permutes overlapped with the weight-gradient product on the "
        "smaller slices, all-reduces then slices on the full tori): an all-reduce moves twice "
        "the bytes of the all-gather it carries out, which the estimate charges, and which the "
        "torus's wrap-around links pay for.",
    ]


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"


def _depth(points: dict) -> list[str]:
    rows = []
    for key, row in points.items():
        if key.startswith("depth:"):
            rows.append((int(key.split(":")[1]), best(row), row))
    if not rows:  # the 32-layer point alone (chips:64) is no comparison
        return []
    if "chips:64" in points:
        rows.append((32, best(points["chips:64"]), points["chips:64"]))
    layers = ", ".join(str(n) for n in sorted(n for n, _, _ in rows))
    out = [
        "## Against depth",
        "",
        f"llama3-8b's layer at {layers} scanned layers, on v5p-128 (64 chips, fsdp=64, "
        "64 x 4,096 tokens, remat full): `--set model.overrides.n_layers=N`.",
        "",
        "| layers | compile s | peak GiB | temporaries GiB | collective GiB per step | step s >= |",
        "|---|---|---|---|---|---|",
    ]
    for layers, p, row in sorted(rows, key=lambda t: t[0]):
        if p is None:
            out.append(f"| {layers} | not compiled: {row.get('error')} | | | | |")
            continue
        mem = p["memory"] or {}
        total = sum(p["collective_bytes_per_step"].values())
        step = (p.get("roofline") or {}).get("step_s", 0)
        out.append(
            f"| {layers} | {p['compile_s']:.0f} | {_gib(p['peak_bytes'])} | "
            f"{_gib(mem.get('temporaries'))} | {_gib(total)} | {step:.3g} |"
        )
    return out + [""]


def _auto(points: dict) -> list[str]:
    rows = [(k, r) for k, r in points.items() if k.startswith("auto:")]
    out = []
    for _, row in rows:
        out += ["## `--mesh auto`", "", f"`{row['command']} --write-recipe planned.toml`", ""]
        if "result" not in row:
            out += [f"did not finish: {row.get('error')}", ""]
            continue
        result = row["result"]
        plans = sorted(result["search"], key=lambda p: -((p.get("roofline") or {}).get("mfu", -1)))
        out += [
            "The compiled plans, ranked by the roofline's MFU (the search prints the same table "
            "and how many points it estimated; all ran on the same slice, batch and sequence):",
            "",
            "| rank | mesh | remat | grad_accum | estimate GiB | peak GiB | headroom | step s >= "
            "| est. MFU <= | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, p in enumerate(plans, 1):
            r = p.get("roofline") or {}
            peak, headroom, step = _gib(p["peak_bytes"]), _headroom(p), f"{r.get('step_s', 0):.3g}"
            if p["refusal"]:  # the compiler's out-of-memory figure, not a peak
                peak, headroom, step = f"refused: needs {peak}", "-", "-"
            out.append(
                f"| {i} | {_mesh(p)} | {p['remat']} | {p['grad_accum']} | "
                f"{_gib(p['estimated_bytes'])} | {peak} | {headroom} | {step} | {_mfu(p)} | "
                f"{p['compile_s']:.0f} |"
            )
        best = result.get("best")
        if best is None:
            out += ["", "No compiled plan left 10% of HBM free.", ""]
            continue
        written = row.get("written_recipe", "")
        tables = written[written.find("[train]") :] if "[train]" in written else written
        out += [
            "",
            f"The best plan with 10% of HBM free, {_mesh(best)} with remat {best['remat']} and "
            f"{best['grad_accum']} accumulated micro-batches, written by `--write-recipe` as a "
            "recipe `eqllm run planned.toml` takes on the slice (its tables from [train] on):",
            "",
            "```toml",
            tables.strip(),
            "```",
            "",
        ]
    return out


def _maxtext(points: dict, maxtext: list) -> list[str]:
    ran = [entry for entry in maxtext if f"maxtext:{entry[0]}" in points]
    if not ran:
        return []
    out = [
        "## Beside MaxText's published runs",
        "",
        "MaxText publishes measured MFU for named configurations (docs/reference/models/"
        "tiering.md of AI-Hypercomputer/maxtext; the tuning in benchmarks/maxtext_*_model_"
        "configs.py). For each one the zoo can express, `eqllm plan zoo:MODEL --topology SLICE "
        "[--slices N] --mesh auto --batch B --seq T --max-compiles 3` plans the same model, "
        "chips, global batch and sequence with eqllm's own step (DeepSeek-V3: the settings "
        "of MaxText's config, on a given mesh). The estimate is eqllm's roofline, not tuned to "
        "these figures; MaxText's is measured. Both count attention's FLOPs whole (PaLM's "
        "convention; `eqllm.train.mfu`), while eqllm's causal attention skips the key blocks "
        "above the diagonal (10 of 16 computed), so a compute-bound step that recomputes little "
        "can pass 100%.",
        "",
        "| model | slice | batch x seq | MaxText: tuning | MaxText MFU (measured) | eqllm plan | "
        "fits, peak GiB | eqllm est. MFU <= |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, name, topology, per_chip, seq, mfu, tuning in ran:
        row = points[f"maxtext:{key}"]
        p = best(row)
        plan = "-"
        if p is not None:
            plan = f"{_mesh(p)}, remat {p['remat']}, accum {p['grad_accum']}"
        fits = row.get("error", "no plan") if p is None else f"{_fits(p)}, {_gib(p['peak_bytes'])}"
        host = _host(p)
        fits += f" (+{_gib(host)} in the host's memory)" if host else ""
        out.append(
            f"| {name} | {_slices(row, topology)} | {per_chip}/chip x {seq} | {tuning} | "
            f"{'not published' if mfu is None else f'{mfu:.1%}'} | {plan} | {fits} | "
            f"{'-' if p is None else _mfu(p)} |"
        )
    return out + [""] + _beside_maxtext(points, ran)


def _host(p: dict | None) -> int:
    """Bytes a chip of plan `p` keeps in its host's memory (remat offload); 0 for none."""
    return (p and p["memory"] and p["memory"].get("host")) or 0


def _at_once(p: dict) -> int:
    """Sequences a chip of plan `p` holds at a time: its share of one accumulation step."""
    return p["batch"] // (p["mesh"]["data"] * p["mesh"]["fsdp"] * p["grad_accum"])


def _beside_maxtext(points: dict, ran: list) -> list[str]:
    """Where eqllm's plans of MaxText's configurations need more than those configurations
    imply, and why, from the plans' own figures."""
    flash = sum("flash attention" in tuning for *_, tuning in ran)
    out = [
        "Where eqllm's step needs more memory or communication than these configurations "
        "imply, and why:",
        "",
        f"- **Attention.** {flash} of these {len(ran)} MaxText configurations name flash "
        "attention in their tuning; eqllm's step materialises the [heads / tensor, seq, seq] "
        "scores and keeps their gradient's inputs "
        "([plan.md](../plan.md#what-eqllms-step-does-on-tpu-that-a-tuned-tpu-trainer-does-not)), "
        "whose size per sequence grows with the heads a chip holds and the square of the "
        "sequence. Each plan's accumulation steps and the HBM traffic of its roofline:",
    ]
    for key, name, topology, *_ in ran:
        p = best(points[f"maxtext:{key}"])
        if p is None or not p.get("roofline"):
            continue
        r = p["roofline"]
        out.append(
            f"  - {name} on {_slices(points[f'maxtext:{key}'], topology)}: "
            f"{p['grad_accum']} accumulation steps, HBM "
            f"{r['memory_s']:.3g} s against {r['compute_s']:.3g} s of compute a step "
            f"({r['bound']}-bound)."
        )
    for key, name, *_ in ran:
        p = best(points[f"maxtext:{key}"])
        host = _host(p)
        if not host:
            continue
        mesh, r = p["mesh"], p["roofline"]
        seqs = _at_once(p)
        tried = "; ".join(
            f"{_mesh(q)}, {_at_once(q)} at a time: temporaries "
            f"{_gib(q['memory']['temporaries'])} GiB, peak {_gib(q['peak_bytes'])}"
            for q in points[f"maxtext:{key}"]["result"].get("search", [])
            if q["memory"]
        )
        out.append(
            f"- **Layer inputs, {name}.** Its plan keeps each layer's input in the host's memory "
            f"(remat offload, as MaxText's configuration does): {_gib(host)} GiB per chip, "
            f"{seqs} sequence{'s' * (seqs > 1)} of {p['seq']:,} tokens x {p['n_layers']} layers, "
            "out and back "
            f"over PCIe in {r['host_s']:.3g} s a step. Every chip of a tensor group "
            f"(tensor={mesh['tensor']}) holds that whole input: eqllm's tensor parallelism "
            "splits the weights, not the activations between layers (no sequence parallelism). "
            f"The plans compiled (sequences a chip holds at a time): {tried}."
        )
        if r["dcn_s"]:
            out.append(
                f"- **Between slices, {name}.** The fsdp axis spans the slices: what its "
                f"gathers and reductions send between them takes {r['dcn_s']:.3g} s a step over "
                "the data-center network at each chip's share of it (the megascale runtime's "
                "sends in the compiled program)."
            )
    return out + [""]


def _slices(row: dict, topology: str) -> str:
    """The slice column: `topology`, or "N x topology" where the point joined N slices."""
    args = row["command"].split()
    n = int(args[args.index("--slices") + 1]) if "--slices" in args else 1
    return topology if n == 1 else f"{n} x {topology}"


def _failures(points: dict) -> list[str]:
    failed = [r for r in points.values() if "error" in r]
    if not failed:
        return []
    out = ["## Points that did not compile here", ""]
    for r in failed:
        rss = f", peak host memory {_gib(r.get('peak_rss_bytes'))} GiB"
        out.append(f"- `{r['command']}`: {r['error']} after {r['wall_s']:.0f} s{rss}")
    return out + [""]
