"""The zoo at the scales it names, from the real TPU compiler: writes docs/experiments/at_scale.md.

    python benchmarks/at_scale.py                    # every section; resumes where it stopped
    python benchmarks/at_scale.py --only recipes     # the recipe table alone (prints it too)
    python benchmarks/at_scale.py --write            # rewrite the page from the results file

Each point is one `eqllm plan ... --json` run in its own process (niced, one at a time, with a
time limit): a recipe on its [plan] slice, a published size on a v5p slice sized for it, one
model against chip count (8 to 1,024 chips) and against depth, and MaxText's published
configurations. Results go to docs/experiments/at_scale.json as each point finishes, with the
point's wall time and peak host memory, so a killed run resumes at the next point; a point that
fails (killed, out of time) is kept with what stopped it and not retried unless --redo names
it. The page is written from that file alone. Needs libtpu (`pip install "eqllm[tpu]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eqllm.bench import source_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "experiments" / "at_scale.json"
PAGE = ROOT / "docs" / "experiments" / "at_scale.md"
COMMAND = "python benchmarks/at_scale.py"
GiB = 2**30
HLO = Path(os.environ.get("EQLLM_CACHE", Path.home() / ".cache" / "eqllm")) / "at_scale_hlo"

# MaxText's measured MFU (docs/reference/models/tiering.md of AI-Hypercomputer/maxtext at
# e591f30cb) and the tuning each row points to (benchmarks/maxtext_*_model_configs.py): model,
# chips, per-chip batch, sequence, remat, sharding. llama3.1-8b is eqllm's llama3-8b (the same
# shapes; only the rope frequencies differ).
MAXTEXT = [
    # id, zoo name, slice, per-chip batch, seq, MaxText MFU, MaxText's config and tuning
    ("v6e-llama2-70b", "llama2-70b", "v6e-256", 4, 4096, 0.438,
     "trillium llama2-70b-4096: fsdp_transpose=-1, remat full, flash attention"),
    ("v6e-llama3.1-8b", "llama3-8b", "v6e-256", 4, 8192, 0.4546,
     "trillium llama3_1-8b-8192: fsdp=-1, remat custom (decoder input, q/k/v/out offloaded "
     "to host), flash attention"),
    ("v6e-llama3.1-70b", "llama3.1-70b", "v6e-256", 5, 8192, 0.5033,
     "trillium llama3_1-70b-8192 (92e59fd L959): fsdp=-1, remat custom (decoder input, q/k/v "
     "offloaded), flash attention"),
    ("v6e-llama3.1-405b", "llama3.1-405b", "v6e-256", 1, 8192, 0.3855,
     "trillium llama3-1-405b-8192-fsdp-dcn (5e6a7ca L723): fsdp=64 x tensor=4 (x2 over DCN "
     "in the config), remat custom with offload, flash attention"),
    ("v6e-mixtral-8x7b", "mixtral-8x7b", "v6e-256", 12, 4096, 0.3523,
     "trillium mixtral_8x7b_dropless: fsdp=-1, remat full, megablox grouped matmul"),
    ("v5p-llama2-70b", "llama2-70b", "v5p-1024", 4, 4096, 0.654,
     "v5p llama2_70b_v5p_128 (92e59fd L156): fsdp=-1, remat save_dot_except_mlpwi"),
    # no measured MFU published (tiering.md has no DeepSeek row): the config alone
    ("v5p-deepseek-v3", "deepseek-v3", "v5p-512", 4, 8192, None,
     "v5p deepseek_v3_ep_256_v5p_512: expert=-1 (every chip), capacity factor 1.0 (einsum "
     "experts, no megablox), remat custom (decoder layer input offloaded to host), flash "
     "attention"),
]  # fmt: skip
# Rows whose MaxText config joins several slices over the data-center network (dcn_fsdp).
MAXTEXT_SLICES = {"v6e-llama3.1-405b": 2}
# Rows planned with a given mesh and settings instead of --mesh auto: DeepSeek-V3 with MaxText's
# capacity factor (dropless blocks are 32x the routed rows: refused at 208.72G), on the plan the
# estimate ranks first among those the compiler accepts (fsdp=64,tensor=4 and fsdp=32,tensor=8
# at 16 accumulation steps were refused, 110.90G and 110.56G of temporaries).
MAXTEXT_PLANS = {
    "v5p-deepseek-v3": ["--mesh", "fsdp=32,tensor=8", "--grad-accum", "32", "--remat", "full",
                        "--set", 'model.overrides.moe.impl="dispatch"',
                        "--set", "model.overrides.moe.capacity_factor=1.0"],
}  # fmt: skip
# The v5p Mixtral row of tiering.md (256 chips, 52.56%) links to a tpu-recipes page whose
# tuning is not in the maxtext repository; it is left out rather than guessed.


def points(ordered: bool = True) -> list[dict]:
    """Every point of the page: id, section, and the `eqllm plan` arguments, in the order they
    run; the recipes largest first only when `ordered` (sizing every recipe's model takes half
    a minute, and the page needs only the ids)."""
    from eqllm import zoo
    from eqllm.recipe import load_recipe, recipe_names

    found, size = [], {}
    for name in recipe_names():
        recipe = load_recipe(name)
        if recipe.plan.topology:
            found.append({"id": f"recipe:{name}", "section": "recipes", "args": [name]})
            if ordered:
                size[f"recipe:{name}"] = zoo.param_count(recipe.model.variant)
    # The smallest published size (the recipes start at a billion), on the smallest v5p slice,
    # zoo defaults.
    args = ["zoo:gpt2-small", "--topology", "v5p-8", "--batch", "16", "--seq", "1024"]
    found.append({"id": "size:gpt2-small", "section": "sizes", "args": args})
    # One model against chip count: llama3-8b, FSDP over every chip, one 4,096-token sequence
    # per chip, remat full.
    for chips in (8, 16, 32, 64, 128, 256, 512, 1024):
        args = ["zoo:llama3-8b", "--topology", f"v5p-{2 * chips}", "--mesh", f"fsdp={chips}"]
        args += ["--batch", str(chips), "--seq", "4096", "--remat", "full"]
        found.append({"id": f"chips:{chips}", "section": "chips", "args": args})
    # The same at 64 chips against depth (32 layers is the chips:64 point).
    for layers in (8, 128):
        args = ["zoo:llama3-8b", "--topology", "v5p-128", "--mesh", "fsdp=64", "--batch", "64"]
        args += ["--seq", "4096", "--remat", "full", "--set", f"model.overrides.n_layers={layers}"]
        found.append({"id": f"depth:{layers}", "section": "depth", "args": args})
    # --mesh auto on one slice, the plan it finds written as a recipe.
    args = ["zoo:llama3-8b", "--topology", "v5p-128", "--mesh", "auto", "--batch", "256"]
    args += ["--seq", "8192", "--max-compiles", "2"]
    found.append({"id": "auto:llama3-8b", "section": "auto", "args": args, "write_recipe": True})
    for key, name, topology, per_chip, seq, _, _ in MAXTEXT:  # noqa: B007
        from eqllm.sharding.tpu import parse_slice

        slices = MAXTEXT_SLICES.get(key, 1)
        chips = parse_slice(topology).chips * slices
        args = [f"zoo:{name}", "--topology", topology, "--slices", str(slices)]
        args += MAXTEXT_PLANS.get(key, ["--mesh", "auto", "--max-compiles", "3"])
        args += ["--batch", str(per_chip * chips), "--seq", str(seq)]
        found.append({"id": f"maxtext:{key}", "section": "maxtext", "args": args})
    # One model against chips first, then the largest recipe (whether it compiles here at all),
    # the other recipes largest first (those most likely to need a fix), MaxText's
    # configurations, the rest.
    order = {"chips": 0, "recipe:deepseek-v3": 1, "recipes": 2, "maxtext": 3, "depth": 4}
    order["auto"] = 4
    return sorted(
        found,
        key=lambda p: (order.get(p["id"], order.get(p["section"], 5)), -size.get(p["id"], 0)),
    )


def run_point(point: dict, timeout: float, reserve: float = 1.5 * GiB) -> dict:
    """`eqllm plan ARGS --json` in a niced child process: its result, wall time and peak host
    memory (VmHWM, read while it runs, so a child killed for memory still has its figure). The
    child is stopped when the host's available memory falls below `reserve` bytes, before the
    kernel's out-of-memory killer picks a process (on a shared machine, perhaps another's)."""
    argv = ["nice", "-n", "10", sys.executable, "-m", "eqllm.cli", "plan", *point["args"]]
    argv.append("--json")
    HLO.mkdir(parents=True, exist_ok=True)  # kept outside the repository, to re-read later
    argv += ["--dump-hlo", str(HLO / f"{point['id'].replace(':', '_')}.hlo")]  # auto: the best
    written = Path(tempfile.mkdtemp()) / "planned.toml"
    if point.get("write_recipe"):
        argv += ["--write-recipe", str(written)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0, load, peak = time.time(), os.getloadavg()[0], 0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env, text=True)
        status: int | str | None = None
        left = 0
        while status is None:
            try:
                status = child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                peak = max(peak, _peak_rss(child.pid))
                available = _available()
                if time.time() - t0 > timeout or available < reserve:
                    child.kill()
                    child.wait()
                    status = "timeout" if available >= reserve else "memory"
                    left = available
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    row = {
        "id": point["id"],
        "section": point["section"],
        "command": "eqllm plan " + shlex.join(point["args"]),
        "wall_s": round(time.time() - t0, 1),
        "load_before": round(load, 2),
        "peak_rss_bytes": peak,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "exit": status,
        "commit": source_commit(),  # the code that compiled it
    }
    if written.is_file():  # what `eqllm run` would be given on the slice
        row["written_recipe"] = written.read_text()
        written.unlink()
    written.parent.rmdir()
    if status in (0, 1) and stdout.strip():
        row["result"] = json.loads(stdout)
    elif status == "timeout":
        row["error"] = f"out of time after {timeout:.0f} s"
    elif status == "memory":
        row["error"] = (
            f"stopped at {peak / GiB:.1f} GiB of host memory, with {left / GiB:.1f} GiB left "
            f"available on this {_total() / GiB:.0f} GiB machine"
        )
    elif status == -9:
        row["error"] = "killed by SIGKILL (out of host memory: see `dmesg`)"
    else:
        lines = stderr.strip().splitlines()
        row["error"] = lines[-1][:500] if lines else f"exit {status}"
    return row


def _available() -> int:
    """The host's available memory (bytes), as /proc/meminfo's MemAvailable says."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 2**62


def _total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss(pid: int) -> int:
    """Peak resident memory (bytes) of process `pid` and its children (here: the nice'd
    python)."""
    peak = 0
    for proc in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{proc}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            continue
    return peak


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def reanalyze(row: dict) -> None:
    """Re-read a point's compiled program (its HLO, kept by the run) with the current
    eqllm.bench.hlo, eqllm.bench.collectives and roofline: collectives, FLOPs and bytes scaled
    to the loop trips, and the estimate, without compiling again."""
    from eqllm.bench.collectives import collectives, tally
    from eqllm.bench.hlo import Program
    from eqllm.plan import slice_devices
    from eqllm.plan.kernels import grouped_cost
    from eqllm.plan.plan import implemented
    from eqllm.plan.roofline import estimate
    from eqllm.plan.step import step_cost
    from eqllm.sharding import MeshConfig, make_mesh
    from eqllm.sharding.tpu import parse_slice

    path = HLO / f"{row['id'].replace(':', '_')}.hlo"
    result = row.get("result") or {}
    result = result.get("best") or {} if "best" in result else result  # --mesh auto: its answer
    if not path.is_file() or not result.get("memory"):
        return
    row["reanalyzed_at"] = source_commit()  # the reader's code; the program is `commit`'s
    program = Program(path.read_text())
    found = collectives(program)
    tpu = parse_slice(result["jax_topology"], result["slices"])
    mesh = make_mesh(MeshConfig(**result["mesh"]), slice_devices(tpu))
    devices, shape = list(mesh.devices.flat), {k: int(v) for k, v in mesh.shape.items()}
    # the grouped kernels at their own loop trips, as `eqllm plan` counts them, over the
    # dispatch's blocks the plan recorded (rows per block, routed rows)
    kept = result.get("grouped_kernel_cost_per_chip") or result.pop(
        "grouped_kernel_flops_per_chip", {}
    )
    grouped = grouped_cost(program, (kept["block"], kept["routed"]) if kept.get("block") else None)
    cost = step_cost(result["xla_flops_per_chip"], result["xla_bytes_per_chip"], program, grouped)
    for key, value in zip(
        ("flops", "run_flops", "bytes_accessed", "run_bytes_accessed"), cost, strict=True
    ):
        result[f"{key}_per_chip"] = value
    result["grouped_kernel_cost_per_chip"] = grouped.to_dict()
    result["collectives_per_layer"], result["collectives_per_step"] = tally(found, lambda c: 1)
    layer_bytes, step_bytes = tally(found, lambda c: c.result_bytes)
    result["collective_bytes_per_layer"] = layer_bytes
    result["collective_bytes_per_step"] = step_bytes
    result["implemented_bytes_per_step"] = implemented(found)
    r = estimate(
        tpu,
        devices,
        shape,
        found,
        flops=result["run_flops_per_chip"],
        bytes_accessed=result["run_bytes_accessed_per_chip"],
        model_flops=result["model_flops"],
        offloaded=result["memory"].get("host", 0),  # recorded since remat "offload"
        grad_accum=result["grad_accum"],
    )
    result["roofline"] = r.to_dict()


def load_results() -> dict:
    if RESULTS.is_file():
        return json.loads(RESULTS.read_text())
    return {"machine": {}, "points": {}}


def save_results(results: dict) -> None:
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(RESULTS)  # atomic: a killed run never leaves half a file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="sections: recipes sizes chips depth auto maxtext")
    p.add_argument("--redo", nargs="*", default=[], help="point ids to run again")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per point")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=1.5,
        help="stop a point when the host has less memory available than this (default 1.5)",
    )
    p.add_argument("--write", action="store_true", help="only rewrite the page")
    p.add_argument(
        "--reanalyze",
        action="store_true",
        help="re-read the kept HLO of every compiled point (collectives, FLOPs, estimate), "
        "then rewrite the page",
    )
    args = p.parse_args()
    from eqllm import configure_process

    configure_process()  # libtpu is installed: keep JAX's probe of a TPU backend quiet
    results = load_results()
    import jax

    results["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(_total() / GiB),
        "jax": jax.__version__,
        "libtpu": _version("libtpu"),
    }
    if args.reanalyze:
        for row in results["points"].values():
            reanalyze(row)
        save_results(results)
    elif not args.write:
        todo = [
            pt
            for pt in points()
            if (not args.only or pt["section"] in args.only)
            and (pt["id"] not in results["points"] or pt["id"] in args.redo)
        ]
        for i, point in enumerate(todo, 1):
            command = shlex.join(point["args"])
            print(f"[{i}/{len(todo)}] {point['id']}: eqllm plan {command}", flush=True)
            row = run_point(point, args.timeout, args.reserve_gib * GiB)
            results["points"][point["id"]] = row
            save_results(results)
            print(f"  {row['wall_s']:.0f} s: {row.get('error') or _verdict(row)}", flush=True)
    save_results(results)
    text = write_page(results)
    PAGE.write_text(text)
    if args.only == ["recipes"]:
        print(text.split("## The recipes on their slices")[1].split("\n## ")[0])
    print(f"wrote {PAGE}")
    return 0


def write_page(results: dict) -> str:
    """The page, from the results file alone."""
    from at_scale_text import page  # the page's words, beside this script

    return page(results, COMMAND, MAXTEXT, points(ordered=False))


def _verdict(row: dict) -> str:
    result = row["result"]
    best = result.get("best", result) if "search" in result else result
    if not best:
        return "no plan fits"
    return "fits" if best["fits"] else "does not fit"


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
