"""Which computation of the experts runs where (`moe.impl = "auto"`, the default): a pure
choice of backend, mesh and model (`eqllm.config.experts.choose_impl`), recorded in the run's
summary and report, and on CPU the dense experts bit for bit."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config.experts import choose_impl
from eqllm.sharding.dispatch import experts_impl
from eqllm.train import report as report_mod
from eqllm.train.step import training_loss
from tests.families import TINY_CONFIGS


@pytest.mark.parametrize(
    ("backend", "shards", "n_experts", "impl"),
    [
        ("cpu", 1, 8, "dense"),
        ("cpu", 4, 8, "dense"),  # dispatch is 1.4-1.6x slower on CPU (docs/moe.md)
        ("tpu", 1, 8, "ragged"),  # one device: grouped matmul over the routed rows
        ("gpu", 1, 8, "ragged"),
        ("tpu", 4, 8, "dispatch"),  # the mesh splits the experts
        ("gpu", 8, 8, "dispatch"),
        ("tpu", 3, 8, "ragged"),  # 3 devices cannot split 8 experts evenly
    ],
)
def test_auto_chooses_by_backend_and_mesh(backend, shards, n_experts, impl):
    chosen, why = choose_impl("auto", backend=backend, expert_shards=shards, n_experts=n_experts)
    assert chosen == impl and why.startswith(f"auto on {backend}")


@pytest.mark.parametrize("requested", ["dense", "ragged", "dispatch"])
def test_an_explicit_impl_is_kept(requested):
    for backend in ("cpu", "tpu"):
        assert choose_impl(requested, backend=backend, expert_shards=4, n_experts=8) == (
            requested,
            "set by moe.impl",
        )


def test_the_mesh_axis_that_splits_experts_is_fsdp():
    cfg = TINY_CONFIGS["mixtral"]
    assert cfg.moe.impl == "auto"
    assert experts_impl(cfg, "tpu", {"data": 2, "fsdp": 4})[0] == "dispatch"
    assert experts_impl(cfg, "tpu", {"data": 8})[0] == "ragged"  # experts replicated
    assert experts_impl(TINY_CONFIGS["llama"], "tpu", {"fsdp": 4}) is None


def test_auto_on_cpu_is_the_dense_experts_bit_for_bit():
    auto = eqllm.CausalLM(TINY_CONFIGS["mixtral"], key=jax.random.key(0))
    dense = auto.with_config(moe={"impl": "dense"})
    assert auto.blocks.mlp.impl == "dense"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)
    loss = eqx.filter_jit(lambda m: training_loss(m, tokens)[0])
    assert float(loss(auto)) == float(loss(dense))


def test_the_report_records_the_experts_impl_and_drops(tmp_path):
    from eqllm.recipe import Recipe

    summary = {
        "variant": "mixtral-nano", "params": 1, "steps": 1, "tokens": 1, "step_tokens_per_s": 1.0,
        "loader_tokens_per_s": 1.0, "peak_flops_source": "x", "flops_per_token": 1.0,
        "compile_s": 1.0, "compile_cache": "off", "peak_memory_bytes": 0,
        "peak_memory_kind": "x", "device": "cpu", "wall_s": 1.0,
        "experts": {"impl": "dispatch", "why": "auto on tpu: the mesh splits the experts"},
        "moe_dropped": 0.0125,
    }  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    text = report_mod.write_report(
        tmp_path,
        Recipe.from_dict({"model": {"variant": "mixtral-nano"}, "train": {"steps": 1}}),
        summary,
    ).read_text()
    assert 'computed by moe.impl = "dispatch" (auto on tpu: the mesh splits the experts)' in text
    assert "dropped past the capacity: 1.25% (mean)" in text
    summary["mfu"] = summary["hfu"] = None
    line = [x for x in report_mod.format_summary(summary) if x.startswith("experts:")]
    assert line == [
        "experts: moe.impl dispatch (auto on tpu: the mesh splits the experts); "
        "1.25% of token copies dropped"
    ]


def test_the_tpu_kernel_is_refused_by_name_off_tpu():
    from eqllm.recipe import Recipe, RecipeError
    from eqllm.train.setup import with_experts_impl

    cfg = TINY_CONFIGS["mixtral"].replace(moe={"kernel": "megablox"})
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    assert model.blocks.mlp.kernel == "megablox"
    recipe = Recipe.from_dict({"model": {"variant": "mixtral-nano"}, "train": {"steps": 1}})
    with pytest.raises(RecipeError, match="moe.kernel='megablox' is a TPU kernel and this proce"):
        with_experts_impl(recipe, model)
    auto = eqllm.CausalLM(TINY_CONFIGS["mixtral"], key=jax.random.key(0))
    assert auto.blocks.mlp.kernel == "xla"  # "auto" off TPU
