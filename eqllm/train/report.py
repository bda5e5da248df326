"""The end of a run: final evaluation, summary.json, loss.png, report.md and the printed summary.

`finish_run` also completes a run resumed from its last checkpoint, which runs no step: the
throughput and compile time then come from the rows metrics.jsonl already holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jax

from eqllm import lora
from eqllm.eval.evaluate import evaluate_heldout, evaluate_run, format_eval
from eqllm.hub import save_model
from eqllm.model import CausalLM
from eqllm.recipe import Recipe
from eqllm.runs import RunFolder
from eqllm.train.metrics import Throughput, peak_memory, read_rows
from eqllm.train.mfu import mfu
from eqllm.train.processes import writes_run_files
from eqllm.train.setup import RunSetup


def read_metrics(out_dir: Path) -> list[dict]:
    return read_rows(RunFolder(out_dir).metrics_file)


def summarize(setup: RunSetup, meter: Throughput, *, step: int, traces: int, cache) -> dict:
    """summary.json's numbers (before the final evaluation) for a run that reached `step`."""
    flops_per_token, peak = setup.flops_per_token, setup.peak_flops
    rows = read_rows(setup.log.path)
    train_rows = [r for r in rows if "grad_norm" in r]  # logged (finite) train steps
    if meter.ran:
        step_s = meter.step_s
        compile_s = meter.compile_s if meter.compile_s is not None else meter.first_step_s
        tokens_per_s, loader = meter.tokens_per_s, meter.loader_tokens_per_s
    else:  # resumed at the last step: what the earlier processes measured
        step_s = train_rows[-1]["step_s"] if train_rows else 0.0
        compile_rows = [r["compile_s"] for r in rows if "compile_s" in r]
        compile_s = compile_rows[-1] if compile_rows else None
        tokens_per_s = train_rows[-1]["tokens_per_s"] if train_rows else 0.0
        loader = None
    step_tokens_per_s = setup.tokens_per_step / step_s if step_s else 0.0
    mem, mem_kind = peak_memory()
    # Instruction rows: the share of token slots that are padding, and the tokens/s of the
    # examples themselves (what packing improves; `finetune.pack`).
    padding = setup.data.meta.get("padding_fraction")
    example_tokens_per_s = None if padding is None else step_tokens_per_s * (1 - padding)
    return {
        "variant": setup.recipe.model.variant,
        "params": setup.n_params,
        "steps": step,
        "tokens": step * setup.tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "step_tokens_per_s": step_tokens_per_s,
        "loader_tokens_per_s": loader,
        "mfu": mfu(step_tokens_per_s, flops_per_token, peak, setup.n_devices),
        "peak_flops": peak,
        "peak_flops_source": setup.peak_source,
        "flops_per_token": flops_per_token,
        "hfu": mfu(step_tokens_per_s, setup.hardware_flops_per_token, peak, setup.n_devices),
        "hardware_flops_per_token": setup.hardware_flops_per_token,
        "compile_s": compile_s,
        "compile_cache": str(cache) if cache else "off",
        "traces": traces,
        "peak_memory_bytes": mem,
        "peak_memory_kind": mem_kind,
        "device": jax.devices()[0].device_kind,
        "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
        "padding_fraction": padding,
        "example_tokens_per_s": example_tokens_per_s,
        # A mixture of experts: how its experts were computed and why (moe.impl), and the mean
        # fraction of token copies dropped past the capacity (moe.capacity_factor).
        **({"experts": setup.experts} if setup.experts is not None else {}),
        **_mean_dropped(train_rows),
    }


def _mean_dropped(train_rows: list[dict]) -> dict:
    dropped = [r["moe/dropped"] for r in train_rows if "moe/dropped" in r]
    return {"moe_dropped": sum(dropped) / len(dropped)} if dropped else {}


def finish_run(
    setup: RunSetup,
    model: CausalLM,
    summary: dict,
    *,
    final_eval: bool,
    progress: bool,
    t_start: float,
    echo: Callable[[str], None],
    ema: CausalLM | None = None,
) -> dict:
    """Evaluate (with `final_eval`), write summary.json, loss.png and report.md; the summary.

    `ema` (optim.ema: the model with its trained weights' moving average) is evaluated beside
    the raw weights (summary "ema": {"val": ...}) and written to the run folder's ema/ as an
    eqllm model folder with the tokenizer (`eqllm generate RUN/ema`, `eqllm eval RUN/ema`);
    the run's own model (`eqllm generate RUN`) stays the raw weights."""
    out, recipe, step = setup.out, setup.recipe, summary["steps"]
    if final_eval:  # the objective's own metrics on held-out data (none for some)
        held_out = setup.objective.evaluate(model)
        summary.update(held_out)
        if held_out:
            setup.log.log({"step": step, "tokens": step * setup.tokens_per_step, **held_out})
    if final_eval:
        t_eval = time.perf_counter()
        result = evaluate_run(
            model,
            setup.heldout,
            recipe,
            setup.data.tokenizer,
            chat=setup.chat,
            progress=progress,
        )
        summary["eval_s"] = time.perf_counter() - t_eval
        summary.update({k: v for k, v in result.items() if k != "samples"})
        if "val" in result:
            setup.log.log(
                {
                    "step": step,
                    "tokens": step * setup.tokens_per_step,
                    **{f"val/{k}": v for k, v in result["val"].items() if k != "tokens"},
                    "unigram/bpb": result["unigram"]["bpb"],
                }
            )
        if ema is not None and "val" in result:
            averaged = evaluate_heldout(ema, setup.heldout, recipe)["val"]
            summary["ema"] = {"val": averaged}
            setup.log.log(
                {
                    "step": step,
                    "tokens": step * setup.tokens_per_step,
                    **{f"ema/val/{k}": v for k, v in averaged.items() if k != "tokens"},
                }
            )
        samples = result.get("samples", [])
        if samples and writes_run_files():
            sep = "\n" + "=" * 72 + "\n"
            RunFolder(out).file(RunFolder.SAMPLES_FILE).write_text(sep.join(samples) + "\n")
        summary["samples"] = samples
    summary["wall_s"] = time.perf_counter() - t_start
    setup.log.close()
    for line in format_summary(summary):
        echo(line)
    if ema is not None and writes_run_files():
        folder = RunFolder(out).file(RunFolder.EMA_DIR)
        save_model(lora.merge(ema), folder, tokenizer=setup.data.tokenizer)
        echo(f"EMA weights (optim.ema={recipe.optim.ema:g}): {folder}")
    if writes_run_files():  # the other processes of a multi-process run computed the same
        RunFolder(out).summary_file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        write_loss_plot(out)
        write_expert_load_plot(out)
        write_objective_plot(out, (*setup.objective.metrics, *setup.objective.held_out))
        write_report(out, recipe, summary)
        echo(f"report: {out / 'report.md'}")
    return summary


def format_summary(s: dict) -> list[str]:
    """The lines `eqllm run` prints at the end: evaluation, throughput, compile and wall time."""
    lines = format_eval(s)
    if s.get("ema"):
        v = s["ema"]["val"]
        lines.append(f"EMA weights: val loss {v['loss']:.4f}, bits/byte {v['bpb']:.4f}")
    if s.get("spikes_skipped") is not None:
        lines.append(f"spiking steps skipped: {s['spikes_skipped']}")
    util = f", MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
    if s.get("hfu") is not None and s["hfu"] != s["mfu"]:
        util += f" (HFU {s['hfu']:.1%} with remat)"
    lines.append(
        f"throughput: {_fmt(s['step_tokens_per_s'], ',.0f')} tokens/s per train step{util} "
        f"(loader {_fmt(s['loader_tokens_per_s'], ',.0f')} tokens/s); compile "
        f"{_fmt(s['compile_s'], '.1f')} s; wall {s['wall_s']:.0f} s"
    )
    if s.get("experts"):
        dropped = s.get("moe_dropped")
        lines.append(
            f"experts: moe.impl {s['experts']['impl']} ({s['experts']['why']})"
            + (f"; {dropped:.2%} of token copies dropped" if dropped is not None else "")
        )
    if s.get("padding_fraction") is not None:
        lines.append(
            f"padding: {s['padding_fraction']:.1%} of the rows' tokens; example tokens "
            f"{_fmt(s['example_tokens_per_s'], ',.0f')}/s"
        )
    return lines


def write_loss_plot(out_dir: Path) -> Path | None:
    """loss.png: training and validation loss (nats/token) against tokens seen (and the EMA
    weights' validation loss with optim.ema)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out_dir)
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r and "tokens" in r]
    val = [(r["tokens"], r["val/loss"]) for r in rows if "val/loss" in r]
    ema = [(r["tokens"], r["ema/val/loss"]) for r in rows if "ema/val/loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(*zip(*train, strict=True), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", ms=4)
    if ema:  # optim.ema: the averaged weights on the same held-out tokens
        ax.plot(*zip(*ema, strict=True), "s--", label="validation (EMA weights)", ms=3)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(out_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = RunFolder(out_dir).file(RunFolder.LOSS_PLOT)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_expert_load_plot(out_dir: Path) -> Path | None:
    """expert_load.png for a mixture of experts: per layer, each expert's share of the token
    assignments against tokens seen (1 / n_experts is perfect balance). None without experts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(out_dir) if "expert_load" in r and "tokens" in r]
    if not rows:
        return None
    tokens = [r["tokens"] for r in rows]
    load = [r["expert_load"] for r in rows]  # [row][layer][expert]
    n_layers, n_experts = len(load[0]), len(load[0][0])
    fig, axes = plt.subplots(
        n_layers, 1, figsize=(7, 1.6 * n_layers + 0.8), dpi=120, sharex=True, squeeze=False
    )
    for layer, ax in enumerate(axes[:, 0]):
        for e in range(n_experts):
            ax.plot(tokens, [row[layer][e] for row in load], lw=1)
        ax.axhline(1 / n_experts, color="k", ls=":", lw=0.8)
        ax.set_ylabel(f"layer {layer}")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(f"{Path(out_dir).name}: share of token assignments per expert")
    axes[-1, 0].set_xlabel("tokens seen")
    fig.tight_layout()
    path = RunFolder(out_dir).file(RunFolder.EXPERT_LOAD_PLOT)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_objective_plot(out_dir: Path, names: tuple[str, ...]) -> Path | None:
    """objective.png: an objective's own metrics `names` (rewards, margins, accuracies, KL,
    completion length, ...) against steps, one panel each. None when it has none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out_dir)
    series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in names}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(
        len(series), 1, figsize=(7, 1.7 * len(series) + 0.8), dpi=120, sharex=True, squeeze=False
    )
    for ax, (name, points) in zip(axes[:, 0], series.items(), strict=True):
        ax.plot(*zip(*points, strict=True), "o-" if name.startswith("val") else "-", ms=3)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = RunFolder(out_dir).file(RunFolder.OBJECTIVE_PLOT)
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def write_report(out_dir: Path, recipe: Recipe, s: dict) -> Path:
    """report.md: what was trained, on what, how well and how fast, with samples."""
    val, uni = s.get("val", {}), s.get("unigram", {})
    mem = s["peak_memory_bytes"] / 2**20
    lines = [
        f"# Run report: {recipe.name or Path(out_dir).name}",
        "",
        recipe.description,
        "",
        "| | |",
        "|---|---|",
        f"| variant | {s['variant']} |",
        f"| parameters | {s['params']:,} |",
        f"| steps | {s['steps']:,} |",
        f"| tokens seen | {s['tokens']:,} |",
        f"| final train loss | {_fmt(s.get('final_train_loss'))} |",
        f"| validation loss | {_fmt(val.get('loss'))} |",
        f"| validation perplexity | {_fmt(val.get('perplexity'), '.2f')} |",
        f"| validation bits/byte | {_fmt(val.get('bpb'))} |",
        f"| unigram baseline bits/byte | {_fmt(uni.get('bpb'))} |",
        *(
            [f"| EMA weights' validation loss (RUN/ema) | {_fmt(s['ema']['val']['loss'])} |"]
            if s.get("ema")
            else []
        ),
        *(
            [f"| spiking steps skipped | {s['spikes_skipped']} |"]
            if s.get("spikes_skipped") is not None
            else []
        ),
        f"| train step throughput | {_fmt(s['step_tokens_per_s'], ',.0f')} tokens/s |",
        f"| loader throughput | {_fmt(s['loader_tokens_per_s'], ',.0f')} tokens/s |",
        f"| MFU | {_fmt(s.get('mfu'), '.2%')} (peak {_fmt(s.get('peak_flops'), '.3g')} FLOP/s: "
        f"{s['peak_flops_source']}; {s['flops_per_token']:.3g} FLOPs/token) |",
        f"| HFU (with remat's recomputation) | {_fmt(s.get('hfu'), '.2%')} "
        f"({_fmt(s.get('hardware_flops_per_token'), '.3g')} FLOPs/token) |",
        f"| compile time | {_fmt(s['compile_s'], '.2f')} s (cache: {s['compile_cache']}) |",
        f"| peak memory | {mem:,.0f} MiB ({s['peak_memory_kind']}) |",
        f"| device | {s['device']} |",
        f"| wall time | {s['wall_s']:.1f} s |",
    ]
    if s.get("padding_fraction") is not None:
        lines.append(f"| padding | {s['padding_fraction']:.1%} of the rows' tokens |")
        lines.append(f"| example tokens | {_fmt(s['example_tokens_per_s'], ',.0f')} tokens/s |")
    for label, r in s.get("sources", {}).items():  # a mixture's sources, each on its own
        lines.append(
            f"| validation loss of {label} | {_fmt(r['loss'])} (bits/byte {_fmt(r['bpb'])}) |"
        )
    for label, r in s.get("extra", {}).items():
        lines.append(f"| {label} bits/byte | {_fmt(r['bpb'])} |")
    lines += ["", "![loss](loss.png)", ""]
    if RunFolder(out_dir).file(RunFolder.OBJECTIVE_PLOT).is_file():  # post-training
        held = {k: v for k, v in s.items() if k.startswith("val_")}
        lines += ["## Objective", ""] + [f"- {k}: {_fmt(v)}" for k, v in held.items()]
        lines += ["", "![objective](objective.png)", ""]
    if s.get("experts") or RunFolder(out_dir).file(RunFolder.EXPERT_LOAD_PLOT).is_file():
        lines += ["## Experts", ""]  # a mixture of experts
        if s.get("experts"):
            lines += [f'- computed by moe.impl = "{s["experts"]["impl"]}" ({s["experts"]["why"]})']
        if s.get("moe_dropped") is not None:
            lines += [f"- token copies dropped past the capacity: {s['moe_dropped']:.2%} (mean)"]
        if RunFolder(out_dir).file(RunFolder.EXPERT_LOAD_PLOT).is_file():
            lines += ["", "![expert load](expert_load.png)"]
        lines += [""]
    samples = s.get("samples") or []
    before_file = RunFolder(out_dir).file(RunFolder.SAMPLES_BEFORE_FILE)
    if samples and before_file.is_file():  # a fine-tuning run: the same prompts before and after
        before = json.loads(before_file.read_text())
        lines += ["## Samples before and after fine-tuning", ""]
        for i, text in enumerate(samples):
            if i < len(before):
                lines += ["Before:", "", "```", before[i], "```", ""]
            lines += ["After:", "", "```", text, "```", ""]
    elif samples:
        lines += ["## Samples", ""]
        for text in samples:
            lines += ["```", text, "```", ""]
    lines += ["## Recipe", "", "```toml", recipe.to_toml().rstrip(), "```", ""]
    path = RunFolder(out_dir).report_file
    path.write_text("\n".join(lines))
    return path
