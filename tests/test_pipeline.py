"""Pipeline parallelism on one device: the schedule's values, the bubble, the errors.

The 8-device checks (stages on their own devices, equality with the plain step, checkpoints
across meshes) are in tests/multidevice/test_pipeline_mesh.py.
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.data import DataError
from eqllm.recipe import OptimSpec, Recipe, RecipeError
from eqllm.sharding import (
    MeshConfig,
    MeshError,
    check_divisible,
    estimate_memory,
    per_device_bytes,
)
from eqllm.train import Pipeline, TrainStep, make_optimizer, mean_loss, schedule

CFG = eqllm.zoo.config("llama-nano", n_layers=4, vocab_size=96, max_seq_len=32)


@pytest.mark.parametrize("remat", ["none", "offload"])
def test_the_schedule_computes_the_plain_loss_and_gradients(remat):
    model = eqllm.CausalLM(CFG.replace(remat=remat), key=jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 96)
    want = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model, batch)
    # Four stages of one layer, two microbatches of two rows: 5 ticks, 3 of them partly idle.
    got = eqx.filter_jit(eqx.filter_value_and_grad(Pipeline(4, 2).loss))(model, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30))


def test_bubble_fraction():
    assert Pipeline(4, 12).bubble == pytest.approx(3 / 15)
    assert Pipeline(1, 8).bubble == 0
    assert "4 stages x 1 layers, 12 microbatches, bubble fraction 0.200" in (
        Pipeline(4, 12).describe(CFG)
    )


def test_layers_that_do_not_divide_into_stages_fail_clearly():
    with pytest.raises(MeshError, match="pipeline=3 does not divide n_layers=4"):
        Pipeline(3, 1).check(CFG, 4)
    with pytest.raises(MeshError, match="pipeline=3 does not divide n_layers=4"):
        check_divisible(CFG, {"pipeline": 3})
    recipe = {"model": {"variant": "llama-nano"}, "train": {"steps": 1}, "mesh": {"pipeline": 3}}
    with pytest.raises(RecipeError, match="mesh.pipeline=3 must divide the model's n_layers=4"):
        Recipe.from_dict(recipe)


def test_a_batch_that_does_not_divide_into_microbatches_fails_clearly():
    with pytest.raises(DataError, match="batch of 6 sequences does not split into train.micro"):
        Pipeline(2, 4).check(CFG, 6)
    train = {"steps": 1, "batch_size": 12, "grad_accum": 2, "microbatches": 4}
    with pytest.raises(RecipeError, match="microbatches=4 must divide .* = 6 sequences"):
        Recipe.from_dict({"model": {"variant": "llama-nano"}, "train": train})
    model = eqllm.CausalLM(CFG, key=jax.random.key(0))
    spec = OptimSpec(warmup_steps=0)
    optimizer = make_optimizer(spec, 2, model)
    step = TrainStep(optimizer, schedule(spec, 2), pipeline=Pipeline(2, 4))
    with pytest.raises(DataError, match="batch of 6 sequences does not split"):
        step(model, optimizer.init(eqx.filter(model, eqx.is_inexact_array)), np.zeros((6, 9), int))


def test_mesh_and_memory_know_the_pipeline_axis():
    assert MeshConfig.parse("pipeline=2,data=2,fsdp=2").describe() == (
        "pipeline=2,data=2,fsdp=2,tensor=1"
    )
    shapes = eqx.filter_eval_shape(eqllm.CausalLM, CFG, key=jax.random.key(0))
    stacked = sum(x.size * 4 for x in jax.tree.leaves(shapes.blocks))
    whole = per_device_bytes(shapes, {"data": 8})
    # Each stage holds a quarter of the stacked layers; embeddings and head stay whole.
    assert per_device_bytes(shapes, {"pipeline": 4, "data": 2}) == whole - stacked * 3 // 4
    # A stage keeps its layers' activations for all M + S - 1 ticks: more microbatches, less.
    mesh = {"pipeline": 4, "data": 2}
    few, many = (
        estimate_memory(CFG, mesh, batch_size=16, seq_len=32, microbatches=m) for m in (2, 8)
    )
    assert few.activations > many.activations and few.params == many.params


def test_a_resumed_run_may_move_to_another_mesh_with_force():
    from eqllm.train.guards import ResumeMismatch, resume_changes

    saved = Recipe.from_dict({"model": {"variant": "llama-nano"}, "train": {"steps": 1}})
    moved = saved.replace("mesh.pipeline", 2).replace("train.microbatches", 4)
    with pytest.raises(ResumeMismatch, match="mesh.pipeline: 1 -> 2.*pass --force"):
        resume_changes(saved, moved, force=False, where="config.toml")
    assert len(resume_changes(saved, moved, force=True, where="config.toml")) == 2


# Mixtral-style (softmax top 2 of 4, the switch balance loss) in 2 stages of 2 layers;
# DeepSeek-V3 (a dense first layer, sigmoid routing over groups with a correction bias, the
# sequence-wise balance loss) in 2 stages of 1 expert layer after it; dense and expert layers
# alternating (Llama 4 Maverick's moe.sparse_every=2), a (dense, expert) group per stage; and a
# hybrid (Qwen3-Next: three Gated DeltaNet layers then attention, experts in every layer), one
# group of four per stage.
SMALL = dict(vocab_size=96, d_model=64, max_seq_len=32)
MIXTRAL = eqllm.zoo.config(
    "mixtral-nano", **SMALL, mlp={"d_ff": 64}, moe={"d_ff": 32, "aux_loss_coef": 0.01}
)
MOE_CONFIGS = {
    "mixtral": MIXTRAL,
    "deepseek_v3": eqllm.zoo.config(
        "deepseek_v3-nano",
        **SMALL,
        n_layers=3,
        moe={"bias_update_speed": 0.01, "aux_loss_coef": 0.01, "balance_loss": "sequence"},
    ),
    "alternating": MIXTRAL.replace(**{"moe.sparse_every": 2}),
    # The grouped matmul, batched over the stages with each stage's own group sizes.
    "mixtral_grouped": MIXTRAL.replace(**{"moe.impl": "ragged"}),
    "qwen3_next": eqllm.zoo.config(
        "qwen3_next-nano", **SMALL, n_layers=8, moe={"aux_loss_coef": 0.01}
    ),
}


@pytest.mark.parametrize(
    "family",
    [
        f if f in ("mixtral", "mixtral_grouped") else pytest.param(f, marks=pytest.mark.slow)
        for f in sorted(MOE_CONFIGS)
    ],
)
def test_experts_in_stages_give_the_plain_balance_terms(family):
    """The stages' routings, bubble ticks left out and rows put back in order, give the loss,
    balance loss, expert load and gradients of the plain forward."""
    from eqllm.config.kinds import layer_kinds
    from eqllm.train.objectives.lm import next_token_loss

    config = MOE_CONFIGS[family]
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 96)

    def loss(m, pipeline):
        return next_token_loss(m if pipeline is None else pipeline.wrap(m), batch)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (want, want_parts), want_grads = grad(model, None)
    (got, got_parts), got_grads = grad(model, Pipeline(2, 2))
    assert set(got_parts) == set(want_parts) >= {"aux_loss", "expert_load"}
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_parts["aux_loss"], want_parts["aux_loss"], rtol=1e-6)
    # The loads are counts of the same tokens' choices: equal exactly, one row per expert layer.
    np.testing.assert_array_equal(got_parts["expert_load"], want_parts["expert_load"])
    expert_layers = sum(kind != "dense" for kind in layer_kinds(config))
    assert got_parts["expert_load"].shape == (expert_layers, config.moe.n_experts)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30))


def test_stacks_the_stages_cannot_run_are_refused_by_name():
    from eqllm.train.stages import check_stages

    deepseek = MOE_CONFIGS["deepseek_v3"]
    check_stages(deepseek, 2)  # 1 dense layer, then 2 stages of 1 expert layer
    with pytest.raises(MeshError, match="does not divide the 3 layers after the 1 dense ones"):
        check_stages(deepseek.replace(n_layers=4), 2)
    with pytest.raises(MeshError, match="does not divide the 3 layers after the 1 dense"):
        check_divisible(deepseek.replace(n_layers=4), {"pipeline": 2})
    hybrid = MOE_CONFIGS["qwen3_next"]  # (linear x 3, full) x 2
    check_stages(hybrid, 2)
    with pytest.raises(MeshError, match="pipeline=4 does not divide the 2 repeats of the"):
        check_stages(hybrid, 4)
    with pytest.raises(MeshError, match="do not repeat one pattern"):
        check_stages(hybrid.replace(n_layers=6), 2)  # (L L L F) then L L
    gemma3 = eqllm.zoo.config("gemma3-nano", n_layers=4)  # one stack; its flags are staged
    check_stages(gemma3, 2)
