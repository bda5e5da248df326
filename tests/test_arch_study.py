"""The cross-architecture study (benchmarks/arch_study.py) and its page writer (arch_page.py):
the models' sizes and FLOPs against closed forms, and the page's arithmetic on fabricated rows,
timings and sizes against hand-computed values."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    """A script of benchmarks/ as a module (it imports its neighbours by their bare names)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_load("optimizer_study")
study = _load("arch_study")
_load("arch_timing")
writer = _load("arch_page")


def test_models_match_in_parameters_and_the_steps_equalise_flops():
    ref = study.config("attention", 64, 64)
    # Closed form for the all-attention model: 4 layers of q, k, v, o (4 d^2) and a SwiGLU
    # (3 d d_ff), the untied head (d V); attention 12 L H Q T.
    d, layers, vocab = 64, study.N_LAYERS, ref.vocab_size
    matmul = layers * (4 * d * d + 3 * d * 4 * d) + d * vocab
    attention = 12 * layers * (d // 16) * 16 * study.SEQ_LEN
    assert study.flops_per_token(ref) == 6 * matmul + attention
    ref_sizes = study.sizes(ref, ref)
    assert ref_sizes["steps"] == study.STEPS
    for arch, kinds in (("gated_deltanet", "linear"), ("mamba2", "linear")):
        cfg = study.config(arch, 64, 64)
        assert cfg.linear.kind == arch
        assert cfg.layer_kinds() == (kinds,) * 3 + ("full",)
        assert (cfg.d_model, cfg.n_layers) == (ref.d_model, ref.n_layers)
        s = study.sizes(cfg, ref)
        # The linear layers' projections hold what an attention layer's do: the gap is the
        # convolutions, gates and norms, under 2%.
        gap = s["non_embedding_params"] / ref_sizes["non_embedding_params"] - 1
        assert 0 < gap < 0.02
        # Equal training FLOPs within half a step's worth (the steps are rounded).
        budget = study.STEPS * study.flops_per_token(ref)
        assert abs(s["steps"] * s["flops_per_token"] - budget) <= 0.5 * s["flops_per_token"]
        assert s["steps"] > study.STEPS  # three attention layers fewer: cheaper per token


def test_transfer_points_carry_each_best_with_an_octave_either_side():
    points = study.transfer_points(
        ["attention", "mamba2"], [128], 64, {"attention": -8, "mamba2": -7}
    )
    got = [(study.arch_of(p), p["model.overrides.d_model"], p["optim.lr"]) for p in points]
    assert got[:2] == [("attention", 128, 2.0**-8), ("mamba2", 128, 2.0**-7)]
    assert sorted(got[2:]) == sorted(
        [
            ("attention", 128, 2.0**-9),
            ("attention", 128, 2.0**-7),
            ("mamba2", 128, 2.0**-8),
            ("mamba2", 128, 2.0**-6),
        ]
    )


def row(arch, width, exponent, loss, step_s=0.1, steps=100):
    return {
        "point": f"{arch}-{width}-{exponent}",
        "settings": {},
        "arch": arch,
        "lr": 2.0**exponent,
        "exponent": exponent,
        "d_model": width,
        "steps": steps,
        "tokens": steps * 1024,
        "loss": loss,
        "diverged": loss is None,
        "seconds": 60.0,
        "step_s": step_s,
    }


ROWS = [
    row("attention", 64, -9, 5.2, step_s=0.10),
    row("attention", 64, -8, 5.0, step_s=0.20),  # median of 1024 / 0.1, 1024 / 0.2, 1024 / 0.4
    row("attention", 64, -7, 5.1, step_s=0.40),
    row("mamba2", 64, -9, 4.95, step_s=0.256, steps=114),  # best at the grid's edge
    row("mamba2", 64, -8, 5.05, step_s=0.256, steps=114),
    row("mamba2", 64, -7, None, steps=114),
    row("attention", 128, -8, 4.8, step_s=0.5),
    row("mamba2", 128, -9, 4.9, step_s=0.512, steps=108),
]


def sizes(params, non_embedding, flops, steps, state, b2k, b8k):
    return {
        "params": params,
        "non_embedding_params": non_embedding,
        "flops_per_token": flops,
        "state_flops_per_token": 0.0,
        "steps": steps,
        "state": state,
        "2048": b2k,
        "8192": b8k,
    }


SIZES = {
    "attention/64": sizes(1000, 800, 2.0e6, 100, 0, 2 * 2**20, 8 * 2**20),
    # 808 / 800 = +1.00%; 1.8e6 x 110 / (2.0e6 x 100) = 0.99 -> -1.00%; 8192: 2.5 / 8 = 0.3125x
    "mamba2/64": sizes(1010, 808, 1.8e6, 110, 2**19, 2**20, 2.5 * 2**20),
    "attention/128": sizes(3000, 2800, 6.0e6, 100, 0, 4 * 2**20, 16 * 2**20),
    "mamba2/128": sizes(3050, 2828, 5.6e6, 107, 2**20, 2 * 2**20, 5 * 2**20),
}
TIMINGS = {
    "values": {
        "attention/64": {
            "decode_tokens_s": 400.0,
            "decode_2048_tokens_s": 200.0,
            "decode_8192_tokens_s": 80.0,
        },
        "mamba2/64": {
            "decode_tokens_s": 300.0,
            "decode_2048_tokens_s": 250.0,
            "decode_8192_tokens_s": 240.0,
        },
        "attention/128": {"decode_tokens_s": 200.0, "train_tokens_s": 2000.0},
        "mamba2/128": {"train_tokens_s": 1500.0},  # decode not timed: "-"
    },
    "machine": "test machine",
    "when": "now",
    "loaded": True,
}


def test_page_reports_gaps_losses_speeds_and_bytes_computed_by_hand():
    page = writer.page(
        ROWS,
        [64, 128],
        ["attention", "mamba2"],
        TIMINGS,
        SIZES,
        total=12,
        command="CMD",
        machine=["- machine: test"],
    )
    assert "Regenerate: `CMD`" in page
    assert "- 8 of 12 points finished (4 not run yet: blank cells below), 1 diverged" in page
    # Sizes: the non-embedding gap and the training FLOPs against all attention.
    assert (
        "| 64 | Mamba-2 hybrid | 1,010 | 808 | +1.00% | 1.800 M | 0.000 M | 110 | 112,640 | "
        "0.203 T | -1.00% |" in page
    )
    assert "| 64 | all attention | 1,000 | 800 | +0.00% | 2.000 M |" in page
    # Losses: the best per width, an edge best starred, the difference from all attention.
    assert "| all attention | 5.0000 (2^-8) | 4.8000 (2^-8*) |" in page
    assert "| Mamba-2 hybrid | 4.9500 (2^-9*), -0.050 | 4.9000 (2^-9*), +0.100 |" in page
    assert "- Mamba-2 hybrid: best learning rate 2^-9 at 64, 2^-9 at 128 (+0 octaves" in page
    # Speeds: the sweep's median (1024 / 0.2 = 5,120; 1024 / 0.256 = 4,000) and the ratio;
    # decode after a short prompt and at 2,048 and 8,192 tokens of context (300 / 400,
    # 250 / 200, 240 / 80); at 128 the training step timed alone gives the ratio (1500 / 2000).
    assert "| 64 | all attention | 5,120 | - | 400.0 | 200.0 | 80.0 | 1.00x | 1.00x, 1.00x" in page
    assert (
        "| 64 | Mamba-2 hybrid | 4,000 | - | 300.0 | 250.0 | 240.0 | 0.78x | 0.75x, 1.25x, 3.00x |"
        in page
    )
    assert "| 128 | Mamba-2 hybrid | 2,000 | 1,500 | - | - | - | 0.75x |  |" in page
    assert "a machine loaded by other people's jobs" in page
    # Cache bytes: MiB and the ratio at 8,192.
    assert "| 64 | Mamba-2 hybrid | 0.50 | 1.00 | 2.50 | 0.312x |" in page
    assert "| 128 | all attention | 0.00 | 4.00 | 16.00 | 1.000x |" in page
    # The grid: a diverged point is "-", a point not run is blank.
    assert "| Mamba-2 hybrid | 64 | 4.950 | 5.050 | - |" in page
    assert "| Mamba-2 hybrid | 128 | 4.900 |  |  |" in page
    assert "can and cannot show" in page


def test_best_exponents_leave_out_diverged_points():
    assert study.best_exponents(ROWS, 64) == {"attention": -8, "mamba2": -9}
    assert writer.train_tokens_s(ROWS, "mamba2", 64) == pytest.approx(1024 / 0.256)
