"""The cross-architecture study of docs/experiments/architectures.md: its sweep and its arithmetic
(the page itself: benchmarks/arch_page.py; the timings: benchmarks/arch_timing.py).

Three architectures of the same depth and d_model per width, trained on the built-in corpus:
all attention (llama-style), a Gated DeltaNet hybrid (qwen3_5-style: three linear layers, then
one attention layer) and a Mamba-2 hybrid (the same pattern with Mamba-2 mixers; every layer
keeps its MLP). Their linear layers are sized so that their projections hold what an attention
layer's do (4 d^2): Gated DeltaNet with value heads twice its key heads (Qwen3.5's ratio),
keys d/2 and values d wide; Mamba-2 with values d wide (expand 1, head_dim 16) and B/C d/2
wide (groups of state size 32). Every head is 16 wide, so heads grow with the width (muP wants
every width axis to grow). The non-embedding parameters then differ by the convolutions, gates
and norms only; the page states the gap.

Each architecture's steps equalise training FLOPs per token x tokens with the all-attention
model's `STEPS` (eqllm's `ModelConfig.flops_per_token` convention: 6 x matmul parameters plus
the attention scores; a linear layer's own state products are left out, see `state_flops`).

Stage one sweeps each architecture's learning rate at the base width under muP; stage two
carries each one's best to the wider widths with an octave either side. `benchmarks/studies.py
architectures` drives both as one resumable `eqllm sweep` (recipes/sweeps/architectures.toml).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import optimizer_study as ostudy

from eqllm.config import ModelConfig
from eqllm.recipe import Recipe
from eqllm.recipe.load import load_recipe
from eqllm.recipe.spec import set_path
from eqllm.sweep.point import count_params

ARCHITECTURES = ("attention", "gated_deltanet", "mamba2")
HEAD_DIM = 16  # every attention, Gated DeltaNet and Mamba-2 head
STATE = 32  # Mamba-2's state size per group
N_LAYERS = 4  # one period of the hybrids' pattern: linear, linear, linear, full
SEQ_LEN = 128
STEPS = 100  # the all-attention model's; the others get the steps of equal FLOPs
BASE_EXPONENTS = (-10, -9, -8, -7)  # AdamW under muP: 2^-8 was best at 2 layers
FIXED = {
    "train.batch_size": 8,
    "optim.warmup_steps": 10,
    "train.log_every": 5,
    "train.eval_every": 25,
    "eval.batches": 5,
    "train.checkpoint_every": 50,
    "eval.sample_tokens": 0,
    "data.seq_len": SEQ_LEN,
    "model.overrides.max_seq_len": SEQ_LEN,
    "model.overrides.n_layers": N_LAYERS,
    "model.overrides.parametrization": "mup",
}


def model_overrides(arch: str, width: int) -> dict:
    """The model settings of one architecture at one width (dotted recipe keys)."""
    heads = width // HEAD_DIM
    settings = {
        "model.overrides.d_model": width,
        "model.overrides.mlp.d_ff": 4 * width,
        "model.overrides.attention.n_heads": heads,
        "model.overrides.attention.n_kv_heads": heads,
        "model.overrides.attention.head_dim": HEAD_DIM,
    }
    if arch == "gated_deltanet":
        linear = {"kind": "gated_deltanet", "n_key_heads": heads // 2, "n_value_heads": heads}
    elif arch == "mamba2":
        linear = {"kind": "mamba2", "n_key_heads": width // (2 * STATE), "n_value_heads": heads}
    else:
        return settings
    key_dim = HEAD_DIM if arch == "gated_deltanet" else STATE
    linear.update(key_head_dim=key_dim, value_head_dim=HEAD_DIM, full_every=N_LAYERS)
    return settings | {f"model.overrides.linear.{k}": v for k, v in linear.items()}


def config(arch: str, width: int, base_width: int) -> ModelConfig:
    """The ModelConfig a point of (arch, width) trains (through the quickstart recipe)."""
    settings = {**FIXED, **model_overrides(arch, width), "model.overrides.base_d_model": base_width}
    recipe = _recipe(settings)
    return recipe.model_config(recipe.data.bpe_vocab_size)


def _recipe(settings: dict) -> Recipe:
    """The quickstart recipe with `settings` applied, as `eqllm sweep` applies a point's."""
    values = load_recipe("quickstart").to_dict()
    for key, value in settings.items():
        set_path(values, key, value)
    return Recipe.from_dict(values)


def flops_per_token(cfg: ModelConfig) -> float:
    return cfg.flops_per_token(SEQ_LEN)


def state_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the linear layers' state products, which
    `flops_per_token` leaves out: the recurrent form's reads and writes of each head's
    key_dim x value_dim state (decay, read, write, output: about 4 multiply-adds per state
    element forward, x 3 for the backward), a lower bound on the chunked form's."""
    lin = cfg.linear
    if lin is None:
        return 0.0
    linear_layers = cfg.layer_kinds().count("linear")
    return 24.0 * linear_layers * lin.n_value_heads * lin.key_head_dim * lin.value_head_dim


def steps_for(cfg: ModelConfig, reference: ModelConfig) -> int:
    """The steps that give `cfg` the training FLOPs of `reference` trained for STEPS."""
    return max(1, round(STEPS * flops_per_token(reference) / flops_per_token(cfg)))


def sizes(cfg: ModelConfig, reference: ModelConfig) -> dict:
    """What the page states of one model: its parameters, FLOPs per token and steps."""
    params, non_embedding = count_params(cfg)
    return {
        "params": params,
        "non_embedding_params": non_embedding,
        "flops_per_token": flops_per_token(cfg),
        "state_flops_per_token": state_flops(cfg),
        "steps": steps_for(cfg, reference),
    }


def point(arch: str, width: int, exponent: int, base_width: int) -> dict:
    reference = config("attention", width, base_width)
    steps = steps_for(config(arch, width, base_width), reference)
    return {
        **model_overrides(arch, width),
        "train.steps": steps,
        "optim.lr": 2.0**exponent,
    }


def arch_of(settings: dict) -> str:
    """A point's architecture, from its overrides."""
    return settings.get("model.overrides.linear.kind", "attention")


def base_points(archs: list[str], width: int) -> list[dict]:
    return [point(a, width, e, width) for a in archs for e in BASE_EXPONENTS]


def transfer_points(archs: list[str], widths: list[int], base: int, best: dict) -> list[dict]:
    """The wider widths' points, narrowest width first (a sweep stopped early then has whole
    widths): each architecture's best base exponent, then an octave either side."""
    return [point(a, w, best[a] + d, base) for w in widths for d in (0, -1, 1) for a in archs]


def study_row(row: dict, summary: dict) -> dict:
    """A results.jsonl row with its architecture, lr exponent and median step time."""
    return {
        **row,
        "arch": arch_of(row["settings"]),
        "exponent": round(math.log2(row["lr"])),
        "step_s": summary.get("step_s"),
    }


def cells_of(rows: list[dict]) -> dict[tuple[str, int], dict[int, dict]]:
    """(architecture, width) -> exponent -> row."""
    cells: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        cells[r["arch"], r["d_model"]][r["exponent"]] = r
    return cells


def best_exponents(rows: list[dict], width: int) -> dict[str, int]:
    """Each architecture's best (lowest final loss, diverged left out) exponent at `width`."""
    best = {}
    for (arch, w), cells in cells_of(rows).items():
        done = {e: r for e, r in cells.items() if r["loss"] is not None}
        if w == width and done:
            best[arch] = min(done, key=lambda e: done[e]["loss"])
    return best


def rows_of(out: Path) -> list[dict]:
    """Every finished point of the architecture sweep with its step time."""
    rows = []
    for folder in sorted(p for p in out.iterdir() if (p / "result.json").is_file()):
        summary = folder / "summary.json"
        rows.append(
            study_row(
                json.loads((folder / "result.json").read_text()),
                json.loads(summary.read_text()) if summary.is_file() else {},
            )
        )
    return rows


def command(args, default_widths: str) -> str:
    """The command line that reruns the study as `args` (an argparse namespace) asks."""
    parts = ["PYTHONPATH=. python benchmarks/studies.py architectures", f"--jobs {args.jobs}"]
    if args.widths != default_widths:
        parts.append(f"--widths {args.widths}")
    if args.out not in (None, "runs/architectures"):
        parts.append(f"--out {args.out}")
    return " ".join(parts)


sweep_toml = ostudy.sweep_toml
