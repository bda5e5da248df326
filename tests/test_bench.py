"""`eqllm bench` arithmetic and a tiny end-to-end run; `eqllm analyze`'s estimators."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS

import eqllm
from eqllm import analyze, cli
from eqllm.bench import BenchResult, parse_overrides, run_bench
from eqllm.train.mfu import measure_cpu_peak, mfu

TINY_SET = (
    "vocab_size=97,d_model=32,n_layers=2,attention.n_heads=4,attention.n_kv_heads=2,"
    "mlp.d_ff=64,max_seq_len=64"
)


def test_flops_per_token_hand_count():
    # llama-like: d=384, L=8, H=6, KV=2, Q=64, d_ff=1024, V=4096, untied head, T=256.
    cfg = eqllm.zoo.config("llama-mini")
    d, L, H, KV, Q, F, V, T = 384, 8, 6, 2, 64, 1024, 4096, 256
    per_layer = d * H * Q + 2 * d * KV * Q + H * Q * d + 3 * d * F  # q, k+v, o, gate/up/down
    expected = 6 * (L * per_layer + d * V) + 12 * L * H * Q * T
    assert cfg.flops_per_token(T) == expected == 6 * (8 * 1_572_864 + 1_572_864) + 1_179_648 * 8
    # gpt2: tied head counted once, 2-matrix MLP, biases/norms/positions excluded.
    g = eqllm.zoo.config("gpt2-nano")
    assert g.flops_per_token(100) == 6 * (4 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 4096) + (
        12 * 4 * 4 * 32 * 100
    )
    # DeepSeek-V3's latent attention: query/key heads of 128 + 64, values of 128, 128 heads.
    ds = eqllm.zoo.config("deepseek-v3")
    assert ds.attention_flops_per_token(4096) == 6 * 61 * 128 * (192 + 128) * 4096


def test_mfu_formula():
    r = BenchResult(
        variant="v",
        framework="eqllm (jax)",
        dtype="float32",
        batch=4,
        seq=50,
        params=1,
        flops_per_token=1e6,
        compile_s=1.0,
        step_s=[0.5, 0.1, 0.2],
        peak_flops=4e9,
        peak_source="test",
        memory_bytes=None,
        memory_source="-",
    )
    assert r.step_median == 0.2
    assert r.tokens_per_s == pytest.approx(200 / 0.2)
    assert r.mfu == pytest.approx(1000 * 1e6 / 4e9)
    assert mfu(1000.0, 1e6, 2e9, n_devices=2) == pytest.approx(0.25)
    assert mfu(1000.0, 1e6, None) is None
    d = r.to_dict()
    assert d["step_min_s"] == 0.1 and d["step_max_s"] == 0.5 and d["mfu"] == pytest.approx(0.25)


def test_cpu_peak_keeps_the_best_figure_seen(tmp_path):
    """A peak cached from a busy moment must not stick (it made MFU read above 100%)."""
    cache = tmp_path / "cpu_peak.json"
    measured = measure_cpu_peak(size=256, repeats=2, cache=cache)
    key = json.loads(cache.read_text())["key"]
    cache.write_text(json.dumps({"key": key, "flops": 1.0}))  # a far too low old figure
    assert measure_cpu_peak(size=256, repeats=2, cache=cache) > 1.0
    assert json.loads(cache.read_text())["flops"] > 1.0
    cache.write_text(json.dumps({"key": key, "flops": 1e3 * measured}))  # a better old figure
    assert measure_cpu_peak(size=256, repeats=2, cache=cache) == 1e3 * measured


def test_parse_overrides():
    assert parse_overrides(["d_model=32,n_layers=2", "norms.eps=1e-6"]) == {
        "d_model": 32,
        "n_layers": 2,
        "norms.eps": 1e-6,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["d_model"])


def test_bench_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "llama-nano", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1"]
    argv += ["--set", TINY_SET, "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "eqllm (jax)" in printed and "6 N + 12 L H Q T" in printed
    report = json.loads((out / "bench.json").read_text())
    (row,) = report["results"]
    cfg = eqllm.zoo.config("llama-nano", **parse_overrides([TINY_SET]))
    assert row["flops_per_token"] == cfg.flops_per_token(16)
    assert len(row["step_s"]) == 2 and row["tokens_per_s"] > 0 and row["compile_s"] > 0
    assert row["params"] == eqllm.zoo.param_count(cfg)
    assert "--set " + TINY_SET in report["meta"]["command"]
    assert "| llama-nano | eqllm (jax) |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0


def test_bench_times_the_document_masked_step(tmp_path, capsys):
    """--document-length: the step on packed documents with segment ids, in the report's command."""
    out = tmp_path / "bench"
    argv = ["bench", "llama-nano", "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0"]
    argv += ["--set", TINY_SET, "--document-length", "4", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["command"].endswith("--document-length 4 --out " + str(out))
    assert report["results"][0]["tokens_per_s"] > 0


def test_count_collectives_per_layer_and_per_step():
    """Ops in loop bodies count per layer; per step they are multiplied by the trip counts."""
    from eqllm.bench.collectives import count_collectives

    hlo = "\n".join(
        [
            "%inner (p: f32[4]) -> f32[4] {",
            "  %ag = f32[8]{0} all-gather(%p), dimensions={0}",
            "  %t = (f32[], /*index=1*/f32[4]) all-reduce(%a, %b), to_apply=%add",
            "}",
            "%outer (p: f32[4]) -> f32[4] {",
            '  %w = f32[4] while(%p), condition=%c, body=%inner, backend_config={"known_trip_'
            'count":{"n":"3"}}',
            "  %rs = f32[2]{0} reduce-scatter(%w), dimensions={0}",
            "}",
            "ENTRY %main (p: f32[4]) -> f32[4] {",
            '  %v = f32[4] while(%p), condition=%c2, body=%outer, backend_config={"known_trip_'
            'count":{"n":"2"}}',
            "  %s = f32[4]{0} all-reduce-start(%all-gather.3), to_apply=%add",
            "  %d = f32[4]{0} all-reduce-done(%s)",
            "}",
        ]
    )
    per_layer, per_step = count_collectives(hlo)
    assert (per_layer["all-gather"], per_layer["all-reduce"], per_layer["reduce-scatter"]) == (
        1,
        1,
        1,
    )
    assert per_step["all-gather"] == 6 and per_step["reduce-scatter"] == 2
    assert per_step["all-reduce"] == 6 + 1  # the tuple all-reduce 6 times, the async one once


def test_collective_bytes_and_gathered_shapes():
    """Bytes of the collectives' results (an async start's results, not its operands), per
    layer and per step, and the shapes all-gathers produce."""
    from eqllm.bench.collectives import collective_bytes, gathered_shapes

    hlo = "\n".join(
        [
            "%body (p: f32[4]) -> f32[4] {",
            "  %ag = bf16[8,2]{1,0} all-gather(%p), dimensions={0}",
            "}",
            "ENTRY %main (p: f32[4]) -> f32[4] {",
            '  %v = f32[4] while(%p), condition=%c, body=%body, backend_config={"known_trip_'
            'count":{"n":"3"}}',
            "  %t = (f32[], /*index=1*/f32[4]{0}) all-reduce(%a, %b), to_apply=%add",
            "  %s = (f32[4]{0}, f32[16]{0}) all-gather-start(%x), dimensions={0}",
            "}",
        ]
    )
    per_layer, per_step = collective_bytes(hlo)
    assert per_layer["all-gather"] == 2 * 8 * 2 and per_layer["all-reduce"] == 0
    assert per_step["all-gather"] == 3 * 32 + 4 * 16 and per_step["all-reduce"] == 4 + 16
    assert gathered_shapes(hlo) == [(8, 2), (16,)]


def test_bench_mesh_cli(tmp_path, capsys):
    """`--mesh` compiles the step from shapes and reports memory; a mesh that does not fit the
    devices is a one-line error (exit 2)."""
    out = tmp_path / "mesh"
    argv = ["bench", "llama-nano", "--batch", "2", "--seq", "16", "--set", TINY_SET]
    assert cli.main([*argv, "--mesh", "data=1", "--out", str(out), "--quiet"]) == 0
    assert "| llama-nano | adamw | one device |" in capsys.readouterr().out
    (row,) = json.loads((out / "bench.json").read_text())["mesh"]
    assert row["argument_bytes"] > 4 * eqllm.zoo.param_count(
        eqllm.zoo.config("llama-nano", **parse_overrides([TINY_SET]))
    )
    assert row["temp_bytes"] > 0 and row["per_step"]["all-reduce"] == 0
    assert "--mesh data=1" in (out / "bench.md").read_text()
    assert cli.main([*argv, "--mesh", f"data={jax.device_count() + 1}"]) == 2
    assert "devices" in capsys.readouterr().err


def test_bench_mesh_muon_counts_newton_schulz(tmp_path):
    """`--optimizer muon`: the compiled step runs, beyond AdamW's, the Newton-Schulz products of
    every hidden matrix on its own (5 iterations of 4 m^2 n + 2 m^3 FLOPs for an (m, n) matrix,
    m <= n), and keeps one momentum per hidden matrix where AdamW keeps two moments."""
    argv = ["bench", "llama-nano", "--batch", "2", "--seq", "16", "--set", TINY_SET, "--quiet"]
    rows = {}
    for name in ("adamw", "muon"):
        out = tmp_path / name
        assert cli.main([*argv, "--mesh", "data=1", "--optimizer", name, "--out", str(out)]) == 0
        (rows[name],) = json.loads((out / "bench.json").read_text())["mesh"]
    cfg = eqllm.zoo.config("llama-nano", **parse_overrides([TINY_SET]))
    d, kv, ff = cfg.d_model, cfg.attention.n_kv_heads * cfg.attention.head_dim, cfg.mlp.d_ff
    shapes = [(d, d), (d, d), (kv, d), (kv, d), (ff, d), (ff, d), (d, ff)]  # q o k v gate up down

    def ns(m, n):
        m, n = min(m, n), max(m, n)
        return 5 * (4 * m * m * n + 2 * m**3)

    expected = cfg.n_layers * sum(ns(*s) for s in shapes)
    # XLA's count also holds the elementwise ops (2.3% more here); one matrix of the stacked
    # layers' rows would count n_layers^2 times the products
    extra = rows["muon"]["flops"] - rows["adamw"]["flops"]
    assert expected <= extra < 1.05 * expected
    hidden = cfg.n_layers * sum(m * n for m, n in shapes)
    saved = rows["adamw"]["argument_bytes"] - rows["muon"]["argument_bytes"]
    assert abs(saved - 4 * hidden) < 100  # the step counts and Muon's 5 x 3 coefficients aside
    assert rows["muon"]["optimizer"] == "muon"
    assert cli.main(["bench", "llama-nano", "--optimizer", "muon"]) == 2  # times AdamW only


@pytest.mark.slow
def test_bench_vs_torch_tiny():
    pytest.importorskip("transformers")
    results = run_bench(
        ["gpt2-nano"],
        batch=2,
        seq=8,
        steps=1,
        warmup=1,
        vs_torch=True,
        torch_compile=False,
        overrides=parse_overrides(
            ["vocab_size=97,d_model=32,n_layers=2,attention.n_heads=4,mlp.d_ff=64"]
        ),
        log=lambda s: None,
    )
    assert [r.framework for r in results] == ["eqllm (jax)", "transformers eager"]
    # Same architecture on both sides: same parameter count (GPT-2's tied head counted once).
    assert results[0].params == results[1].params
    assert results[0].flops_per_token == results[1].flops_per_token


def test_hessian_top_eigenvalue_quadratic():
    eigs = jnp.array([5.0, 2.0, 1.0, 0.5, -0.3])
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (5, 5)))
    a = q @ jnp.diag(eigs) @ q.T

    # Two leaves, to exercise pytree handling: x = [u, w].
    def loss(p, b):
        x = jnp.concatenate([p["u"], p["w"]])
        return 0.5 * x @ a @ x + 0.0 * b

    params = {"u": jnp.ones(2), "w": jnp.ones(3)}
    top, history = analyze.hessian_top_eigenvalue(
        loss, params, jnp.zeros(()), key=jax.random.key(0), iters=100, tol=1e-7
    )
    assert top == pytest.approx(5.0, rel=1e-4)
    assert len(history) > 1


def test_gradient_noise_scale_known_distribution():
    # loss = mean_j 0.5 |theta - x_j|^2 with x_j ~ N(mu, s^2 I): per-example gradient
    # theta - x_j, so G = theta - mu and tr(Sigma) = d s^2.
    d, s = 10, 0.5
    theta, mu = jnp.ones(d), jnp.zeros(d)
    x = mu + s * jax.random.normal(jax.random.key(3), (4000, 4, d))  # 4000 micro-batches of 4
    loss = lambda p, xb: 0.5 * jnp.mean(jnp.sum((p - xb) ** 2, axis=-1))  # noqa: E731
    r = analyze.gradient_noise_scale(loss, theta, x, micro_size=4)
    assert r["trace_sigma"] == pytest.approx(d * s**2, rel=0.05)
    assert r["grad_sq"] == pytest.approx(float(jnp.sum((theta - mu) ** 2)), rel=0.05)
    assert r["b_simple"] == pytest.approx(d * s**2 / d, rel=0.1)


@pytest.mark.slow
def test_analyze_model_smoke():
    model = eqllm.CausalLM(TINY_CONFIGS["llama"].replace(n_layers=1), key=jax.random.key(0))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 9)), jnp.int32)
    r = analyze.analyze_model(model, batch, micro_batch=2, iters=2)
    assert np.isfinite(r["hessian_top_eigenvalue"]) and len(r["hessian_iterations"]) <= 2
    assert r["noise_scale"]["n_micro_batches"] == 2 and r["seq_len"] == 8
    assert np.isfinite(r["noise_scale"]["trace_sigma"])
    assert r["loss"] == pytest.approx(float(eqllm.train.mean_loss(model, batch)), rel=1e-5)
    with pytest.raises(ValueError, match="micro-batches"):
        analyze.analyze_model(model, batch[:2], micro_batch=2)


def test_analyze_rejects_non_run_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        analyze.analyze_run(tmp_path)
