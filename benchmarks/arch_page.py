"""The page of the cross-architecture study, docs/experiments/architectures.md, from its rows
(one per finished point of the sweep), its timings and its sizes (benchmarks/arch_study.py
and arch_timing.py); arithmetic only, so it is tested on fabricated rows."""

from __future__ import annotations

import statistics

import arch_study as xstudy
from arch_timing import CONTEXTS

NAMES = {
    "attention": "all attention",
    "gated_deltanet": "Gated DeltaNet hybrid",
    "mamba2": "Mamba-2 hybrid",
}
# A second seed moved a point near the optimum by up to this much (docs/experiments/mutransfer.md,
# the same quickstart setup): loss differences below it are within one-seed noise.
SEED_NOISE = 0.12


def best_rows(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """(architecture, width) -> its point of lowest final loss (diverged points left out)."""
    best = {}
    for key, cells in xstudy.cells_of(rows).items():
        done = [r for r in cells.values() if r["loss"] is not None]
        if done:
            best[key] = min(done, key=lambda r: r["loss"])
    return best


def train_tokens_s(rows: list[dict], arch: str, width: int) -> float | None:
    """Median training tokens/s of the sweep's points of (arch, width): tokens per step over
    each point's median step time."""
    speeds = [
        r["tokens"] / r["steps"] / r["step_s"]
        for r in rows
        if r["arch"] == arch and r["d_model"] == width and r.get("step_s") and r["steps"]
    ]
    return statistics.median(speeds) if speeds else None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def page(rows, widths, archs, timings, sizes, *, total, command, machine) -> str:
    """The page from any subset of the points (blank cells for those not run yet)."""
    base = widths[0]
    best = best_rows(rows)
    cells = xstudy.cells_of(rows)
    diverged = sum(r["diverged"] for r in rows)
    fixed = xstudy.FIXED
    lines = [
        "# All attention against Gated DeltaNet and Mamba-2 hybrids at equal parameters and FLOPs",
        "",
        f"Regenerate: `{command}` (runs or resumes `eqllm sweep` over "
        "recipes/sweeps/architectures.toml: a learning-rate sweep per architecture at the base "
        "width, then its best and an octave either side at the wider widths; then times each "
        "model and writes this page and architectures.json). Add `--no-run` to rewrite the page "
        "from the finished points and `--retime` to measure the timings again (on an idle "
        "machine: the losses, parameters, FLOPs and cache bytes do not depend on the load).",
        "",
        *machine,
        f"- {len(rows)} of {total} points finished"
        + (f" ({total - len(rows)} not run yet: blank cells below)" if len(rows) < total else "")
        + f", {diverged} diverged",
        f"- every point: the quickstart recipe's corpus and BPE-1024 tokenizer, {xstudy.N_LAYERS} "
        f"layers, d_ff = 4 x d_model, heads of {xstudy.HEAD_DIM}, muP with base width {base}, "
        f"AdamW, batch {fixed['train.batch_size']} x seq {xstudy.SEQ_LEN}, warmup "
        f"{fixed['optim.warmup_steps']}, cosine to the run's own last step; the loss is the "
        f"validation loss on {fixed['eval.batches']} held-out batches after the last step",
        "- the hybrids: three linear layers then one attention layer (`linear.full_every = 4`), "
        "every layer with its MLP. Gated DeltaNet: value heads twice the key heads (Qwen3.5's "
        "ratio), keys d/2 and values d wide. Mamba-2: values d wide (expand 1, head_dim 16), B "
        f"and C d/2 wide (d/{2 * xstudy.STATE} groups of state {xstudy.STATE})",
        "",
        "## The models: parameters, FLOPs and steps",
        "",
        f"Training FLOPs per token are eqllm's `ModelConfig.flops_per_token({xstudy.SEQ_LEN})`: 6 "
        "x matmul parameters (the head included, the embedding table not) plus the attention "
        "scores, 12 x layers x heads x head_dim x T. That convention leaves out a linear "
        "layer's own state products (linear in T); the column after it estimates them (24 x "
        "state elements per linear layer: read, decay, write and output, forward and backward, "
        "of the recurrent form) to show how small they are here. Each architecture gets the "
        f"steps that give it the all-attention model's FLOPs at {xstudy.STEPS} steps (rounded "
        "to a whole step): the hybrids have three attention layers fewer, so more steps.",
        "",
        "| d_model | architecture | params | non-embedding | vs all attention | FLOPs / token "
        "| state FLOPs / token (left out) | steps | tokens | training FLOPs | vs all attention |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in widths:
        ref = sizes[f"attention/{w}"]
        ref_flops = ref["flops_per_token"] * ref["steps"]
        for a in archs:
            s = sizes[f"{a}/{w}"]
            gap = s["non_embedding_params"] / ref["non_embedding_params"] - 1
            flops = s["flops_per_token"] * s["steps"]
            tokens = s["steps"] * fixed["train.batch_size"] * xstudy.SEQ_LEN
            lines.append(
                f"| {w} | {NAMES[a]} | {s['params']:,} | {s['non_embedding_params']:,} | "
                f"{gap:+.2%} | {s['flops_per_token'] / 1e6:.3f} M | "
                f"{s['state_flops_per_token'] / 1e6:.3f} M | {s['steps']} | {tokens:,} | "
                f"{flops * tokens / s['steps'] / 1e12:.3f} T | "
                f"{flops / ref_flops - 1:+.2%} |"
            )
    lines += [
        "",
        "## Validation loss per architecture and width",
        "",
        "Each width's best point (the learning rate in brackets; * marks a best at the edge of "
        "that width's grid, where the optimum may lie further out) and its difference from the "
        "all-attention model's best at the same width.",
        "",
        "| architecture | " + " | ".join(f"d_model {w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for a in archs:
        values = []
        for w in widths:
            r = best.get((a, w))
            if r is None:
                values.append("")
                continue
            edge = "*" if r["exponent"] in (min(cells[a, w]), max(cells[a, w])) else ""
            text = f"{r['loss']:.4f} (2^{r['exponent']}{edge})"
            ref = best.get(("attention", w))
            if a != "attention" and ref is not None:
                text += f", {r['loss'] - ref['loss']:+.3f}"
            values.append(text)
        lines.append(f"| {NAMES[a]} | " + " | ".join(values) + " |")
    moves = []
    for a in archs:
        found = [(w, best[a, w]["exponent"]) for w in widths if (a, w) in best]
        if len(found) > 1:
            moves.append(
                f"- {NAMES[a]}: best learning rate "
                + ", ".join(f"2^{e} at {w}" for w, e in found)
                + f" ({found[-1][1] - found[0][1]:+d} octaves from {found[0][0]} to "
                f"{found[-1][0]})"
            )
    if moves:
        lines += ["", "How far the best learning rate moved from the base width:", "", *moves]
    lines += _speed(rows, widths, archs, timings) + _cache(widths, archs, sizes)
    lines += _grid(cells, widths, archs) + _limits(widths, sizes)
    return "\n".join(lines) + "\n"


def _speed(rows, widths, archs, timings) -> list[str]:
    values = timings["values"]
    state = (
        "an idle machine"
        if not timings.get("loaded", True)
        else "a machine loaded by other people's jobs (several times its 2 cores' worth): "
        "compare rows measured together, not with other pages"
    )
    lines = [
        "",
        "## Tokens per second",
        "",
        f"Decode and the training step timed alone were measured on {state}; "
        f"{timings['machine']}, {timings['when']}. Training, during the sweep: tokens per step "
        "over each point's median step time (AdamW, batch 8 x seq 128), the median over the "
        "width's points, measured while the sweep ran. Training, timed alone (`--retime` "
        "only): the real training step, the median of 10 steps after 2 warmup. Decode: new "
        "tokens/s of greedy `eqllm.generate` at batch 1 (64 tokens after a 16-token prompt, "
        "compiled first, best of 3), random weights of the same shapes; at 2,048 and 8,192 "
        "tokens of context, the prompt fills all but the 64 new tokens and is prefilled first, "
        "then the engine's one decode call of the other 63 tokens is timed alone (best of 3); "
        "without `--retime` only at the widest width (each model's decode compiles for "
        "minutes on the loaded machine).",
        "",
        "| d_model | architecture | training tokens/s, during the sweep | training tokens/s, "
        "timed alone | decode tokens/s | at 2,048 context | at 8,192 context | training vs all "
        "attention | decode vs all attention (short, 2,048, 8,192) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in widths:
        ref = values[f"attention/{w}"]
        ref_sweep = train_tokens_s(rows, "attention", w)
        for a in archs:
            v = values[f"{a}/{w}"]
            sweep = train_tokens_s(rows, a, w)
            alone = v.get("train_tokens_s")
            if alone is not None:
                ratio = f"{alone / ref['train_tokens_s']:.2f}x"
            else:
                ratio = f"{sweep / ref_sweep:.2f}x" if sweep and ref_sweep else ""
            keys = ["decode_tokens_s"] + [f"decode_{n}_tokens_s" for n in CONTEXTS]
            decode = [v.get(k) for k in keys]
            versus = ", ".join(f"{d / ref[k]:.2f}x" for d, k in zip(decode, keys, strict=True) if d)
            lines.append(
                f"| {w} | {NAMES[a]} | {f'{sweep:,.0f}' if sweep else ''} | "
                f"{'-' if alone is None else f'{alone:,.0f}'} | "
                + " | ".join("-" if d is None else f"{d:,.1f}" for d in decode)
                + f" | {ratio} | {versus} |"
            )
    return lines


def _cache(widths, archs, sizes) -> list[str]:
    lines = [
        "",
        "## Cache bytes per request",
        "",
        "What one request holds in the serving engine (`eqllm.generation.sizing.request_bytes`, "
        "float32 as trained, whole blocks of 16 positions): the attention layers' keys and "
        "values for every position, plus the linear layers' recurrent state (convolution and "
        "state matrices), which does not grow with the context. Exact, from shapes alone.",
        "",
        "| d_model | architecture | recurrent state MiB | 2,048 tokens MiB | 8,192 tokens MiB "
        "| 8,192 vs all attention |",
        "|---|---|---|---|---|---|",
    ]
    for w in widths:
        ref = sizes[f"attention/{w}"]
        for a in archs:
            s = sizes[f"{a}/{w}"]
            lines.append(
                f"| {w} | {NAMES[a]} | {_mib(s['state'])} | {_mib(s['2048'])} | "
                f"{_mib(s['8192'])} | {s['8192'] / ref['8192']:.3f}x |"
            )
    return lines


def _grid(cells, widths, archs) -> list[str]:
    exponents = sorted({e for c in cells.values() for e in c})
    lines = [
        "",
        "## Every point",
        "",
        "Final validation loss (- : diverged, stopped early).",
        "",
        "| architecture | d_model | " + " | ".join(f"2^{e}" for e in exponents) + " |",
        "|---|---|" + "---|" * len(exponents),
    ]
    for a in archs:
        for w in widths:
            c = cells.get((a, w), {})
            values = [
                "" if e not in c else "-" if c[e]["loss"] is None else f"{c[e]['loss']:.3f}"
                for e in exponents
            ]
            lines.append(f"| {NAMES[a]} | {w} | " + " | ".join(values) + " |")
    return lines


def _limits(widths, sizes) -> list[str]:
    low = min(s["params"] for s in sizes.values())
    high = max(s["params"] for s in sizes.values())
    return [
        "",
        "## What this range can and cannot show",
        "",
        f"The models hold {low / 1e6:.2f}M to {high / 1e6:.2f}M parameters and train for about "
        f"{xstudy.STEPS} steps ({xstudy.STEPS * 8 * xstudy.SEQ_LEN:,} tokens) on one seed.",
        "",
        "- **Can:** that the three architectures train on the same recipe under muP, whether "
        "each one's best learning rate stays put as the width grows (the transfer muP "
        "promises, per architecture), which one reaches the lower loss at equal parameters "
        "and FLOPs in this short budget when the gap is well above the seed noise, the exact "
        "parameter, FLOP and cache-byte arithmetic (the cache's growth with context is the "
        "hybrids' reason to exist: one attention layer in four keeps a quarter of the KV "
        "bytes, plus a state that does not grow), and the relative step and decode costs of "
        "eqllm's implementations on a CPU.",
        f"- **Cannot:** rank the architectures at scale. One seed moved a loss near the "
        f"optimum by up to {SEED_NOISE} in the same setup (docs/experiments/mutransfer.md, a "
        "second seed), so loss differences below about 0.1 are noise; a gap measured after "
        "~100 steps at seq 128 says how fast each one learns early on short contexts, not "
        "where it converges nor how it uses long contexts (where a linear layer's fixed state "
        "and attention's growing cache differ most); the published comparisons (Gated "
        "DeltaNet, Mamba-2 and their hybrids) train 1B+ parameters on billions of tokens. Nor "
        "can CPU tokens/s predict an accelerator's: the linear layers' chunked scans and the "
        "attention core cost differently there, and these timings were taken under other "
        "people's load.",
        "",
    ]
