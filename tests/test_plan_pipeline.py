"""`eqllm plan` with a mixture of experts in the pipeline schedule: the auto search considers
pipeline splits for it, and the TPU compiler compiles the stages with the experts kept split."""

import pytest

from eqllm.plan.report import describe
from eqllm.plan.step import planned_config
from tests.test_plan import compiled, expert_gathers, nano, needs_libtpu


def test_the_search_considers_pipelines_for_mixtures_of_experts():
    """A mixture of experts runs in the pipeline schedule (its balance terms carried through
    the stages), so `--mesh auto` counts pipeline splits for it: Mixtral's 4 layers in 2 or 4
    stages, DeepSeek-V3's expert layers after its dense prefix (3 of 4: no even split)."""
    from eqllm.plan.search import _splits

    mixtral = nano("mixtral-nano").model_config()
    assert {p for p, *_ in _splits(mixtral, 8)} == {1, 2, 4}
    deepseek = nano("deepseek_v3-nano").model_config()  # 1 dense layer, 3 expert layers
    assert {p for p, *_ in _splits(deepseek, 8)} == {1}
    assert {p for p, *_ in _splits(deepseek.replace(n_layers=3), 8)} == {1, 2}
    config, experts = planned_config(nano("mixtral-nano"), {"pipeline": 2, "fsdp": 2})
    assert config.moe.impl == experts["impl"] == "dense"
    assert experts["why"].startswith("auto in a pipeline: the stages run under jax.vmap")


@needs_libtpu
@pytest.mark.slow  # one more TPU compile (about a minute here)
def test_a_pipeline_of_experts_compiles_for_tpu_with_experts_kept_split():
    """Two stages of a Mixtral nano on 4 v5p chips, its 4 experts split over fsdp=2 inside
    each: the plan compiles, says how the experts run and why, hands activations between the
    stages (collective permutes) and never gathers a layer's expert weights whole."""
    recipe = nano("mixtral-nano", "train.microbatches=2")
    plan = compiled(recipe, "v5p-8", "pipeline=2,fsdp=2")
    assert plan.fits and plan.step.experts["impl"] == "dense"
    text = describe(plan)
    assert (
        "2 pipeline microbatches" in text and "experts: moe.impl dense (auto in a pipeline" in text
    )
    assert any(c.kind == "collective-permute" for c in plan.step.collectives)
    assert not expert_gathers(plan)
