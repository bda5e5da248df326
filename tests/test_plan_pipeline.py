"""`eqllm plan` with a mixture of experts in the pipeline schedule: the auto search considers
pipeline splits for it, and the TPU compiler compiles the stages with tokens dispatched to the
experts, which stay split."""

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
    # In the stages "auto" chooses as without them: token dispatch where fsdp splits the experts.
    config, experts = planned_config(nano("mixtral-nano"), {"pipeline": 2, "fsdp": 2})
    assert config.moe.impl == experts["impl"] == "dispatch"
    assert experts["why"] == "auto on tpu: the mesh splits the experts over 2 devices"
    config, experts = planned_config(nano("mixtral-nano"), {"pipeline": 2, "data": 2})
    assert experts["impl"] == "ragged"


@needs_libtpu
def test_a_pipeline_of_experts_compiles_for_tpu_with_tokens_dispatched():
    """Two stages of a Mixtral nano on 4 v5p chips, its 4 experts split over fsdp=2 inside
    each: the plan compiles, says how the experts run and why, hands activations between the
    stages (collective permutes), sends tokens to their experts (all-to-alls) through the
    grouped-matmul kernel and never gathers a layer's expert weights whole."""
    recipe = nano("mixtral-nano", "train.microbatches=2")
    plan = compiled(recipe, "v5p-8", "pipeline=2,fsdp=2")
    assert plan.fits and plan.step.experts["impl"] == "dispatch"
    assert plan.step.experts["kernel"] == "megablox"
    text = describe(plan)
    assert "2 pipeline microbatches" in text and "experts: moe.impl dispatch (auto on tpu" in text
    kinds = {c.kind for c in plan.step.collectives}
    assert {"collective-permute", "all-to-all"} <= kinds
    assert not expert_gathers(plan)
    # A stage dispatches one microbatch at a time: 8 x 64 tokens over 2 microbatches and 2
    # fsdp chips is 128 rows a chip, top 2 of 2 local experts, so blocks of 2 x 256 rows of
    # which 256 are routed; the kernels run on those, half of what the compiler counts.
    grouped = plan.step.grouped
    assert (grouped.block, grouped.routed) == (512, 256)
    assert grouped.run == pytest.approx(grouped.static / 2) and grouped.run > 0
