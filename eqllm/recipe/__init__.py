"""Recipe: the frozen, nested description of one training run, read from `recipes/<name>.toml`.

A recipe names a zoo variant (with overrides), the data, the optimizer and schedule, the batch,
the length of training, precision, checkpointing, evaluation and the seed. Everything is checked
(by pydantic, plus the checks in `Recipe.check`) when the recipe is loaded, before anything is
compiled: an unknown key, a value of the wrong type, an unknown variant or a missing data path
fails with a one-line RecipeError that names the key path (`train.batch_size`), the value and
what is allowed.

    recipe = load_recipe("quickstart", overrides=["train.steps=50"])
    recipe.train.steps  # 50
"""

from eqllm.recipe.checks import implied_objective
from eqllm.recipe.corpus import prepare_corpus
from eqllm.recipe.errors import RecipeError
from eqllm.recipe.inputs import finetune_data_path, preference_data_source
from eqllm.recipe.load import (
    apply_overrides,
    load_recipe,
    parse_value,
    recipe_names,
    recipe_path,
)
from eqllm.recipe.optim import OptimSpec, Schedule
from eqllm.recipe.sections import (
    PREFERENCE_LOSSES,
    DataSpec,
    DistillSpec,
    EvalSpec,
    FinetuneMethod,
    FinetuneSpec,
    ModelSpec,
    PlanSpec,
    Precision,
    PreferenceSpec,
    RLSpec,
    SourceKind,
    SourceSpec,
    TrainSpec,
    WeightStage,
)
from eqllm.recipe.spec import RUN_LENGTH, Recipe

__all__ = [
    "RUN_LENGTH",
    "PREFERENCE_LOSSES",
    "DataSpec",
    "DistillSpec",
    "EvalSpec",
    "FinetuneMethod",
    "FinetuneSpec",
    "PreferenceSpec",
    "RLSpec",
    "ModelSpec",
    "OptimSpec",
    "PlanSpec",
    "Precision",
    "Recipe",
    "RecipeError",
    "Schedule",
    "SourceKind",
    "SourceSpec",
    "WeightStage",
    "TrainSpec",
    "finetune_data_path",
    "preference_data_source",
    "apply_overrides",
    "implied_objective",
    "load_recipe",
    "prepare_corpus",
    "parse_value",
    "recipe_names",
    "recipe_path",
]
