"""`eqllm coordcheck`: the activation walk equals the model, and the slopes tell SP from muP."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqllm.bench.coordcheck import activations, coord_check, sized_config
from eqllm.errors import EqllmError
from eqllm.model import CausalLM


def test_a_linear_layers_heads_grow_with_the_width():
    # As attention's head_dim: a Gated DeltaNet's key and value heads, a Mamba-2's head_dim; a
    # Mamba-2's state size (its key_head_dim) is not a width and stays.
    sizes = dict(depth=None, base_width=64, base_depth=None, vocab_size=97, seq_len=16)
    for variant, grows in (("qwen3_5-nano", (True, True)), ("mamba2-nano", (False, True))):
        base = sized_config(variant, "mup", width=64, **sizes).linear
        wide = sized_config(variant, "mup", width=256, **sizes).linear
        for dim, grow in zip(("key_head_dim", "value_head_dim"), grows, strict=True):
            assert getattr(wide, dim) == getattr(base, dim) * (4 if grow else 1), (variant, dim)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["olmo_hybrid-nano", "mamba2-nano"])
def test_the_walk_computes_a_hybrids_logits(variant):
    cfg = sized_config(
        variant,
        "mup",
        width=64,
        depth=None,
        base_width=32,
        base_depth=None,
        vocab_size=97,
        seq_len=16,
    )
    model = CausalLM(cfg, key=jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)))
    means, logits = activations(model, tokens)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5, rtol=1e-5)
    assert ("mlp.0" in means) == (cfg.linear.mlp)  # Mamba-2's blocks have no MLP


# A hybrid (Gated DeltaNet layers with gated attention; OLMo hybrid's head is untied, so the
# check zeroes it as for llama) is flat under muP and grows under SP, as a Llama is.
@pytest.mark.slow
def test_a_hybrid_is_flat_under_mup_and_grows_under_sp():
    mup = coord_check("olmo_hybrid-nano", "mup", widths=(64, 128, 256))
    sp = coord_check("olmo_hybrid-nano", "sp", widths=(64, 128, 256))
    assert max(abs(s) for v in mup.slopes.values() for s in v) < 0.2, mup.slopes
    assert max(s for v in sp.slopes.values() for s in v) >= 0.5, sp.slopes


@pytest.mark.slow
def test_the_walk_computes_the_models_logits():
    cfg = sized_config(
        "llama-nano",
        "completep",
        width=64,
        depth=4,
        base_width=32,
        base_depth=2,
        vocab_size=97,
        seq_len=16,
    )
    assert (cfg.d_model, cfg.mlp.d_ff, cfg.head_dim, cfg.n_layers) == (64, 192, 16, 4)
    model = CausalLM(cfg, key=jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)))
    means, logits = activations(model, tokens)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5, rtol=1e-5)
    assert set(means) == {
        "embed",
        "attn.0",
        "mlp.0",
        "attn.last",
        "mlp.last",
        "residual",
        "logits",
    }
    np.testing.assert_allclose(means["logits"], jnp.mean(jnp.abs(model(tokens))), rtol=1e-5)


# The check's defaults (3 steps at lr 1e-2, 0.1 for Adafactor; the fan-in init 1 / sqrt(base
# width); a zero head; 2 x 8 random tokens; 3 seeds) at the widths the docs show. At 32-128 the
# 16 tokens are too many for the smallest width (muP sloped to -0.35 there). About a minute of
# CPU per optimizer, so every optimizer is slow.
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon", "lion", "adafactor"])
def test_with_the_defaults_mup_is_flat_and_sp_grows(optimizer):
    # Each optimizer with its own muP learning-rate factor (lr / m for AdamW and Lion,
    # lr / sqrt(m) for Adafactor and for Muon's "match_rms_adamw" matrices); under SP the same
    # steps make the hidden outputs grow with width.
    mup = coord_check("llama-nano", "mup", optimizer=optimizer, widths=(64, 128, 256))
    sp = coord_check("llama-nano", "sp", optimizer=optimizer, widths=(64, 128, 256))
    assert set(mup.slopes) == {"embed", "attn.0", "mlp.0", "attn.last", "mlp.last", "residual"} | {
        "logits"
    }
    assert max(abs(s) for v in mup.slopes.values() for s in v) < 0.2, mup.slopes
    # SP: the hidden outputs grow at least as sqrt(width) somewhere (the check can fail).
    assert max(s for v in sp.slopes.values() for s in v) >= 0.5, sp.slopes


def test_zero_readout_needs_an_untied_head():
    with pytest.raises(EqllmError, match="tie_embeddings"):
        coord_check("gpt2-nano", "mup", widths=(32, 64), steps=1, zero_readout=True)


@pytest.mark.slow
def test_coordcheck_command_writes_json_and_plot(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqllm.cli",
            "coordcheck",
            "llama-nano",
            "--parametrization",
            "mup",
            "--widths",
            "32,64",
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--seeds",
            "1",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["sizes"] == [32, 64]
    assert all(len(v) == 2 for v in result["slopes"].values())
    assert (tmp_path / "coord_check.png").stat().st_size > 0
    bad = subprocess.run(
        [sys.executable, "-m", "eqllm.cli", "coordcheck", "llama-nano", "--widths", "32"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--widths" in bad.stderr


def test_a_depth_check_takes_one_width(monkeypatch):
    """Over depth the width is fixed, so one --widths value is enough (two are needed over
    width); the options reach coord_check as given."""
    from eqllm.cli import build_parser
    from eqllm.commands import coordcheck as command

    seen = {}

    def fake(variant, parametrization, **kw):
        seen.update(kw, variant=variant, parametrization=parametrization)
        raise SystemExit(0)

    monkeypatch.setattr(command, "coord_check", fake)
    argv = ["coordcheck", "llama-nano", "--parametrization", "completep", "--widths", "64"]
    args = build_parser().parse_args([*argv, "--depths", "2,4", "--init-std", "0.1"])
    with pytest.raises(SystemExit):
        args.func(args)
    assert (seen["widths"], seen["depths"], seen["init_std"]) == ((64,), (2, 4), 0.1)
    assert (seen["batch"], seen["seq_len"], seen["seeds"], seen["steps"]) == (2, 8, 3, 3)
    # The head starts at zero when it is untied, the init is the fan-in one, Adam's optimizer.
    assert (seen["zero_readout"], seen["lr"], seen["optimizer"]) == (None, None, "adamw")
    args = build_parser().parse_args([*argv, "--depths", "2,4", "--no-zero-readout"])
    with pytest.raises(SystemExit):
        args.func(args)
    assert (seen["zero_readout"], seen["init_std"]) == (False, None)
    args = build_parser().parse_args(argv)
    with pytest.raises(EqllmError, match="--widths '64' must be two or more"):
        args.func(args)
