"""The studies of docs/scaling-laws.md: run (or resume) their sweeps, then write their pages.

    PYTHONPATH=. python benchmarks/studies.py mutransfer [--jobs 2]
    PYTHONPATH=. python benchmarks/studies.py scaling [--jobs 2]
    PYTHONPATH=. python benchmarks/studies.py optimizers [--jobs 2] [--widths 64,128,256]
        [--optimizers adamw,muon,lion] [--set KEY=VALUE ...] [--out DIR] [--page FILE] [--no-run]
    PYTHONPATH=. python benchmarks/studies.py architectures [--jobs 1] [--widths 64,128,256]
        [--no-run] [--retime]

`mutransfer` runs recipes/sweeps/mutransfer.toml into runs/mutransfer (SP and muP, widths 64-512,
learning rates 2^-14 to 2^-4) and writes docs/experiments/mutransfer.md: each width's best
learning rate and loss per parametrization, how far the best learning rate moves across the
widths, and the whole grid of losses. `scaling` runs recipes/sweeps/scaling.toml into
runs/scaling (IsoFLOP sizes at three budgets, written by benchmarks/scaling_sweep.py with the
muP learning rate the first study found best at the base width) and writes
docs/experiments/scaling_laws.md: both fits of `eqllm fit` on every budget, and on all but the
largest with the prediction of the largest. `optimizers` runs the optimizer study of
benchmarks/optimizer_study.py (a learning-rate sweep per optimizer at the base width, then a few
octaves around each one's best under muP and SP at the wider widths; recipes/sweeps/optimizers.toml
holds both stages) into runs/optimizers and writes docs/experiments/optimizers.md; `--no-run` only
writes the page from the points that finished. `architectures` runs the cross-architecture study
of benchmarks/arch_study.py (all attention, a Gated DeltaNet hybrid and a Mamba-2 hybrid at equal
parameters and training FLOPs; the same two stages) into runs/architectures and writes
docs/experiments/architectures.md with architectures.json beside it (its rows, timings and
sizes); `--retime` measures the timings again, the training step included. Finished points are
not run again, so a rerun after an interruption resumes, and a rerun of a finished study only
rewrites its page; `architectures` also counts the rows its page's .json file keeps as finished,
so a fresh clone runs only the points the page lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

import arch_page
import arch_study as xstudy
import arch_timing
import jax
import optimizer_page
import optimizer_study as study

import eqllm
from eqllm.bench import source_commit
from eqllm.recipe.load import parse_value
from eqllm.scaling import describe, fit_points, plot_fit, read_results
from eqllm.sweep import load_sweep, run_sweep
from eqllm.train.metrics import read_rows

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "experiments"


def run(name: str, jobs: int) -> tuple[Path, list[dict], float, int]:
    """Run (or resume) recipes/sweeps/<name>.toml into runs/<name>: its rows, the wall seconds
    and how many points this call ran."""
    sweep = load_sweep(ROOT / "recipes" / "sweeps" / f"{name}.toml")
    out = ROOT / "runs" / name
    before = sum((out / p.name / "result.json").is_file() for p in sweep.points)
    start = time.perf_counter()
    stopped = run_sweep(sweep, out, jobs=jobs)
    if stopped:
        raise SystemExit(f"the {name} sweep stopped: {stopped}; run the same command again")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, rows, time.perf_counter() - start, len(rows) - before


def machine() -> str:
    return (
        f"{os.cpu_count()} CPU threads, {jax.devices()[0].platform}, jax {jax.__version__}, "
        f"commit `{source_commit()}`"
    )


def timing(rows: list[dict], wall: float, ran: int, jobs: int) -> str:
    points = sum(r["seconds"] for r in rows) / 60
    if ran == len(rows):
        return f"wall time {wall / 60:.1f} minutes, {jobs} points at a time ({points:.1f} in all)"
    return f"the points' own wall times add up to {points:.1f} minutes ({jobs} at a time)"


def hand_written(page: Path) -> str:
    """The hand-written sections of a generated page (its first "## " heading and all after it:
    follow-up runs with their own commands), which regenerating the page keeps."""
    text = page.read_text() if page.is_file() else ""
    at = text.find("\n## ")
    return "" if at < 0 else text[at:]


def mutransfer(jobs: int) -> None:
    out, rows, wall, ran = run("mutransfer", jobs)
    grid: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        grid[r["parametrization"], r["d_model"]][round(math.log2(r["lr"]))] = r
    exponents = sorted({e for cells in grid.values() for e in cells})
    lines = [
        "# muTransfer: the best learning rate across widths, SP against muP",
        "",
        "Regenerate: `PYTHONPATH=. python benchmarks/studies.py mutransfer --jobs 2` (runs or "
        "resumes `eqllm sweep recipes/sweeps/mutransfer.toml --out runs/mutransfer`, then "
        "writes this page). What it shows and why: [Scaling laws](../scaling-laws.md#the-studies).",
        "",
        f"- machine: {machine()}",
        f"- {timing(rows, wall, ran, jobs)}",
        f"- each point: {rows[0]['steps']} steps, {rows[0]['tokens']:,} tokens, "
        f"{rows[0]['n_layers']} layers; the loss is the final validation loss",
        "",
        "| parametrization | d_model | params | best lr | best loss | diverged |",
        "|---|---|---|---|---|---|",
    ]
    best: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for (param, width), cells in sorted(grid.items()):
        finished = {e: r for e, r in cells.items() if r["loss"] is not None}
        e_best = min(finished, key=lambda e: finished[e]["loss"])
        loss = finished[e_best]["loss"]
        best[param].append((width, e_best, loss))
        diverged = sum(r["diverged"] for r in cells.values())
        params = next(iter(cells.values()))["params"]
        lines.append(
            f"| {param} | {width} | {params:,} | 2^{e_best} | {loss:.4f} | {diverged} of "
            f"{len(cells)} |"
        )
    lines += ["", "How far the best learning rate moves from the narrowest to the widest:", ""]
    for param, entries in best.items():
        es = [e for _, e, _ in entries]
        losses = [loss for _, _, loss in entries]
        lines.append(
            f"- {param}: best lr 2^{es[0]} at d_model {entries[0][0]}, 2^{es[-1]} at "
            f"{entries[-1][0]}: a range of {max(es) - min(es)} octave(s) over the widths; best "
            f"loss {losses[0]:.4f} to {losses[-1]:.4f}"
        )
    header = " | ".join(f"2^{e}" for e in exponents)
    lines += [
        "",
        "Final validation loss of every point (- : diverged, stopped early):",
        "",
        f"| parametrization | d_model | {header} |",
        "|---|---|" + "---|" * len(exponents),
    ]
    for (param, width), cells in sorted(grid.items()):
        values = [
            "" if e not in cells else "-" if cells[e]["loss"] is None else f"{cells[e]['loss']:.3f}"
            for e in exponents
        ]
        lines.append(f"| {param} | {width} | " + " | ".join(values) + " |")
    shutil.copy(out / "lr_transfer.png", DOCS / "mutransfer_lr_transfer.png")
    lines += ["", "![loss against log2 learning rate per width](mutransfer_lr_transfer.png)", ""]
    page = DOCS / "mutransfer.md"
    page.write_text("\n".join(lines) + hand_written(page))
    print(f"wrote {DOCS / 'mutransfer.md'}")


def scaling(jobs: int) -> None:
    out, rows, wall, ran = run("scaling", jobs)
    points = read_results(out / "results.jsonl")
    every = fit_points(points)
    held = fit_points(points, holdout_largest=True)
    for path in plot_fit(points, every, out):
        shutil.copy(path, DOCS / f"scaling_{path.name}")
    (out / "fits.json").write_text(json.dumps({"all": every, "holdout": held}, indent=2))
    lines = [
        "# Scaling laws fitted on this machine",
        "",
        "Regenerate: `PYTHONPATH=. python benchmarks/studies.py scaling --jobs 2` (runs or "
        "resumes `eqllm sweep recipes/sweeps/scaling.toml --out runs/scaling`, fits "
        "`eqllm fit runs/scaling/results.jsonl` with and without `--holdout-largest`, then "
        "writes this page). What it can and cannot say: "
        "[Scaling laws](../scaling-laws.md#the-studies).",
        "",
        f"- machine: {machine()}",
        f"- {timing(rows, wall, ran, jobs)}",
        f"- every run: muP, learning rate {rows[0]['lr']!r} (tuned at the base width), "
        f"{rows[0]['n_layers']} layers, a cosine schedule over its own steps",
        "",
        "| budget (FLOPs) | d_model | params | steps | tokens | tokens / param | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (float(f"{r['flops']:.1e}"), r["params"])):
        loss = "diverged" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(
            f"| {r['flops']:.2e} | {r['d_model']} | {r['params']:,} | {r['steps']} | "
            f"{r['tokens']:,} | {r['tokens'] / r['params']:.1f} | {loss} |"
        )
    lines += ["", "Fitted on every budget (`eqllm fit runs/scaling/results.jsonl`):", "", "```"]
    lines += describe(every)
    lines += ["```", "", "Fitted without the largest budget, which it then predicts "]
    lines[-1] += "(`eqllm fit runs/scaling/results.jsonl --holdout-largest`):"
    lines += ["", "```", *describe(held), "```", ""]
    lines += [
        "![IsoFLOP profiles and approach 2](scaling_fit_isoflop.png)",
        "![approach 3 against the measured losses](scaling_fit_law.png)",
        "",
    ]
    (DOCS / "scaling_laws.md").write_text("\n".join(lines))
    print(f"wrote {DOCS / 'scaling_laws.md'}")


def optimizers(args: argparse.Namespace) -> None:
    """Stage one (the base width's learning rates), stage two (the wider widths around each
    optimizer's best), then the page; `--no-run` writes the page from what finished."""
    widths = [int(w) for w in args.widths.split(",")]
    names = args.optimizers.split(",")
    extra = dict(item.split("=", 1) for item in args.set)
    fixed = {**study.FIXED, "model.overrides.base_d_model": widths[0]}
    fixed.update({k: parse_value(v) for k, v in extra.items()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "optimizers.toml"
    header = f"The optimizer study (benchmarks/optimizer_study.py), written by\n  {_command(args)}"
    base = study.base_points(names, widths[0])
    start, ran = time.perf_counter(), 0
    for _ in range(2):  # stage one until its points are done, then both stages
        rows = _study_rows(out)
        done = {json.dumps(r["settings"], sort_keys=True) for r in rows}
        best = study.best_exponents(rows, widths[0])
        if all(json.dumps(p, sort_keys=True) in done for p in base):
            extension = study.extension_points(names, widths[0], best)
            points = base + extension + study.transfer_points(names, widths[1:], best)
            spec.write_text(study.sweep_toml(fixed, points, header + "\nboth stages"))
            if out.resolve() == (ROOT / "runs" / "optimizers").resolve():
                shutil.copy(spec, ROOT / "recipes" / "sweeps" / "optimizers.toml")
            if not args.no_run:
                ran += _run_stage(spec, out, args.jobs)
                rows = _study_rows(out)
            break
        spec.write_text(study.sweep_toml(fixed, base, header + "\nstage one only"))
        if args.no_run:
            break
        ran += _run_stage(spec, out, args.jobs)
    planned = len(study.transfer_points(names, widths[1:], dict.fromkeys(names, 0)))
    total = len(base) + planned
    if set(best) == set(names) and len(rows) >= len(base):
        total += len(study.extension_points(names, widths[0], best))
    (out / "study.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [f"- machine: {machine()}"]
    if rows:
        lines.append(f"- {timing(rows, time.perf_counter() - start, ran, args.jobs)}")
    page = optimizer_page.page(
        rows, widths, names, total=total, command=_command(args), machine=lines
    )
    Path(args.page).write_text(page)
    print(f"wrote {args.page} ({len(rows)} of {total} points)")


def _key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


def _run_stage(spec: Path, out: Path, jobs: int, done: list[dict] = ()) -> int:
    """Run (or resume) a sweep file into `out`, but for the points whose rows are in `done`;
    how many points this call ran."""
    sweep = load_sweep(spec)
    finished = {_key(r["settings"]) for r in done}
    sweep = dataclasses.replace(
        sweep, points=tuple(p for p in sweep.points if _key(p.settings) not in finished)
    )
    before = sum((out / p.name / "result.json").is_file() for p in sweep.points)
    stopped = run_sweep(sweep, out, jobs=jobs)
    if stopped:
        raise SystemExit(f"the sweep stopped: {stopped}; run the same command again")
    return sum((out / p.name / "result.json").is_file() for p in sweep.points) - before


def _study_rows(out: Path) -> list[dict]:
    """study.jsonl's rows: every finished point with its curve and step time."""
    rows = []
    for folder in sorted(p for p in out.iterdir() if (p / "result.json").is_file()):
        row = json.loads((folder / "result.json").read_text())
        summary = folder / "summary.json"
        rows.append(
            study.study_row(
                row,
                read_rows(folder / "metrics.jsonl"),
                json.loads(summary.read_text()) if summary.is_file() else {},
            )
        )
    return rows


def _command(args: argparse.Namespace) -> str:
    parts = ["PYTHONPATH=. python benchmarks/studies.py optimizers", f"--jobs {args.jobs}"]
    if args.widths != WIDTHS:
        parts.append(f"--widths {args.widths}")
    if args.optimizers != OPTIMIZERS:
        parts.append(f"--optimizers {args.optimizers}")
    parts += [f"--set {item}" for item in args.set]
    if args.out != DEFAULT_OUT:
        parts.append(f"--out {args.out}")
    if args.page != str(DOCS / "optimizers.md"):
        parts.append(f"--page {args.page}")
    return " ".join(parts)


def architectures(args: argparse.Namespace) -> None:
    """Stage one (each architecture's learning rates at the base width), stage two (the wider
    widths around each one's best), the timings, then the page; `--no-run` writes the page
    from what finished, `--retime` measures the timings again (on an idle machine)."""
    widths = [int(w) for w in args.widths.split(",")]
    archs = list(xstudy.ARCHITECTURES)
    out = Path(args.out or "runs/architectures")
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "architectures.toml"
    fixed = {**xstudy.FIXED, "model.overrides.base_d_model": widths[0]}
    header = "The cross-architecture study (benchmarks/arch_study.py), written by\n  "
    header += xstudy.command(args, WIDTHS)
    base = xstudy.base_points(archs, widths[0])
    start, ran = time.perf_counter(), 0
    results = Path(args.page).with_suffix(".json")
    saved = json.loads(results.read_text()) if results.is_file() else {}

    def finished() -> list[dict]:  # the points run here, and those the page's file keeps
        rows = xstudy.rows_of(out)
        here = {_key(r["settings"]) for r in rows}
        return rows + [r for r in saved.get("rows", []) if _key(r["settings"]) not in here]

    for _ in range(2):  # stage one until its points are done, then both stages
        rows = finished()
        done = {_key(r["settings"]) for r in rows}
        if all(_key(p) in done for p in base):
            best = xstudy.best_exponents(rows, widths[0])
            points = base + xstudy.transfer_points(archs, widths[1:], widths[0], best)
            spec.write_text(xstudy.sweep_toml(fixed, points, header + "\nboth stages"))
            if out.resolve() == (ROOT / "runs" / "architectures").resolve():
                shutil.copy(spec, ROOT / "recipes" / "sweeps" / "architectures.toml")
            if not args.no_run:
                ran += _run_stage(spec, out, args.jobs, rows)
                rows = finished()
            break
        spec.write_text(xstudy.sweep_toml(fixed, base, header + "\nstage one only"))
        if args.no_run:
            break
        ran += _run_stage(spec, out, args.jobs, rows)
    wall = time.perf_counter() - start
    total = len(base) + 3 * len(archs) * (len(widths) - 1)
    configs = {(a, w): xstudy.config(a, w, widths[0]) for w in widths for a in archs}
    timings = saved.get("timings") if not args.retime else None
    if timings is None or set(timings["values"]) != {f"{a}/{w}" for a, w in configs}:
        timings = {
            "values": arch_timing.measure(
                configs,
                xstudy.SEQ_LEN,
                train=args.retime,
                decode_widths=widths if args.retime else widths[-1:],
            ),
            "machine": machine(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loaded": not args.retime,
        }
    long = f"decode_{arch_timing.CONTEXTS[-1]}_tokens_s"
    older = [
        (a, w) for a, w in configs if w == widths[-1] and long not in timings["values"][f"{a}/{w}"]
    ]
    for a, w in older:  # measured before the decode at long contexts: add it
        timings["values"][f"{a}/{w}"] |= arch_timing.decode_at_contexts(configs[a, w])
        print(f"timed decode of {a} at {w}: {timings['values'][f'{a}/{w}']}")
    if older:  # every decode figure is new: the page names this machine and time
        timings |= {
            "machine": machine(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    sizes = {
        f"{a}/{w}": {**xstudy.sizes(cfg, configs["attention", w]), **arch_timing.cache_bytes(cfg)}
        for (a, w), cfg in configs.items()
    }
    results.write_text(
        json.dumps({"rows": rows, "timings": timings, "sizes": sizes}, indent=1) + "\n"
    )
    lines = [f"- machine: {machine()}"]
    if rows:
        lines.append(f"- {timing(rows, wall, ran, args.jobs)}")
    page = arch_page.page(
        rows,
        widths,
        archs,
        timings,
        sizes,
        total=total,
        command=xstudy.command(args, WIDTHS),
        machine=lines,
    )
    Path(args.page).write_text(page)
    print(f"wrote {args.page} ({len(rows)} of {total} points)")


WIDTHS, OPTIMIZERS, DEFAULT_OUT = "64,128,256", "adamw,muon,lion", "runs/optimizers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=("mutransfer", "scaling", "optimizers", "architectures"))
    parser.add_argument("--jobs", type=int, default=2, help="points at once (default 2)")
    group = parser.add_argument_group("optimizers")
    group.add_argument("--widths", default=WIDTHS, help="d_model values, the first the base")
    group.add_argument("--optimizers", default=OPTIMIZERS, help="of adamw,muon,lion,soap")
    group.add_argument(
        "--set", action="append", default=[], help="a fixed override KEY=VALUE (repeatable)"
    )
    group.add_argument("--out", default=None, help="the sweep folder (default runs/STUDY)")
    group.add_argument("--page", default=None, help="the page written (docs/experiments/...)")
    group.add_argument("--no-run", action="store_true", help="write the page from what finished")
    group.add_argument(
        "--retime", action="store_true", help="architectures: measure the timings again"
    )
    args = parser.parse_args()
    eqllm.configure_process()  # as the `eqllm` command does (the sweeps run in this process)
    if args.study == "optimizers":
        args.out = args.out or DEFAULT_OUT
        args.page = args.page or str(DOCS / "optimizers.md")
        optimizers(args)
    elif args.study == "architectures":
        args.page = args.page or str(DOCS / "architectures.md")
        architectures(args)
    else:
        {"mutransfer": mutransfer, "scaling": scaling}[args.study](args.jobs)


if __name__ == "__main__":
    main()
