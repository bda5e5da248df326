"""Recipe: the whole run, its derived values and the checks that span sections."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Annotated, Any

import tomli_w
from pydantic import (
    BeforeValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from eqllm import zoo
from eqllm.config import ConfigError, ModelConfig, show, validated
from eqllm.config.kinds import pipeline_layers
from eqllm.recipe.checks import (
    check_finetune,
    check_objective,
    check_plan,
    check_stability,
    implied_objective,
    value_at,
)
from eqllm.recipe.errors import RecipeError, recipe_error
from eqllm.recipe.inputs import check_data_files, check_source, check_tokenizer, source_label
from eqllm.recipe.optim import OptimSpec
from eqllm.recipe.sections import (
    CONFIG,
    PREFERENCE_LOSSES,
    DataSpec,
    DistillSpec,
    EvalSpec,
    FinetuneSpec,
    ModelSpec,
    PlanSpec,
    PreferenceSpec,
    RLSpec,
    Str,
    TrainSpec,
)
from eqllm.sharding import MeshConfig, MeshError

# The length of training: exactly one is given; setting one replaces the others.
RUN_LENGTH = ("train.steps", "train.tokens", "train.tokens_per_param")
# ModelConfig fields the recipe sets from its own fields, and where.
_FROM_TRAIN = {"compute_dtype": "train.precision", "remat": "train.remat"}


def _strict_mesh(value: Any) -> Any:
    # MeshConfig is a plain dataclass, which pydantic would fill from "2" or 2.0 as well.
    if isinstance(value, dict):
        for key, size in value.items():
            if isinstance(size, bool) or not isinstance(size, int):
                raise MeshError(f"mesh.{key}={show(size)} must be a positive integer or -1")
    return value


@typing.no_type_check  # pydantic checks the fields
@validated(CONFIG, lambda error, cls: recipe_error(error, cls))
class Recipe:
    """A complete training run. Build with `load_recipe` or `Recipe.from_dict`."""

    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec)
    preference: PreferenceSpec = Field(default_factory=PreferenceSpec)
    rl: RLSpec = Field(default_factory=RLSpec)
    distill: DistillSpec = Field(default_factory=DistillSpec)
    mesh: Annotated[MeshConfig, BeforeValidator(_strict_mesh)] = Field(default_factory=MeshConfig)
    plan: PlanSpec = Field(default_factory=PlanSpec)
    name: Str = ""
    description: Str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, inputs: bool = True) -> Recipe:
        """The recipe these plain values (a parsed TOML file) describe, checked.

        `inputs` False leaves out the checks of the outside world (data and tokenizer paths):
        how a run folder's saved recipe is read on a machine that has none of its data.
        """
        if not isinstance(values, dict):
            raise RecipeError(f"the recipe must be a table, got {show(values)}")
        try:
            return _ADAPTER.validate_python(values, context={"inputs": inputs})
        except ValidationError as e:
            raise recipe_error(e, cls) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists, not tuples) that `from_dict` turns back into this recipe."""
        return _ADAPTER.dump_python(self, mode="json")

    def to_toml(self) -> str:
        """The recipe as TOML text (loads back to an equal recipe)."""
        return tomli_w.dumps(self.to_dict())

    def replace(self, path: str, value: Any) -> Recipe:
        """A copy with the field at `path` ("train.steps") set to `value` (checked).

        Setting one of train.steps / tokens / tokens_per_param unsets the other two.
        """
        values = self.to_dict()
        if path in RUN_LENGTH:
            clear_run_length(values)
        set_path(values, path, value)
        return Recipe.from_dict(values)

    # Derived values ---------------------------------------------------------------------------

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The variant with its overrides, train.precision and train.remat applied.

        vocab_size: the tokenizer's size; a model trained from scratch gets it (rounded up to a
        multiple of 64) unless the overrides set vocab_size explicitly.
        """
        overrides = dict(self.model.overrides)
        if self.model.parametrization:
            overrides.setdefault("parametrization", self.model.parametrization)
        overrides["compute_dtype"] = self.train.precision
        overrides["remat"] = self.train.remat
        if vocab_size is not None and "vocab_size" not in self.model.overrides:
            if not self.model.init_from:
                overrides["vocab_size"] = -(-vocab_size // 64) * 64
        try:
            entry = zoo.entry(self.model.variant)
        except ConfigError as e:
            raise RecipeError(f"model.variant: {e}") from None
        try:
            return entry.config.replace(**overrides)
        except ConfigError as e:
            raise RecipeError(f"model.overrides: {e}") from None

    def bpe_vocab_size(self) -> int:
        if self.data.bpe_vocab_size:
            return self.data.bpe_vocab_size
        return self.model_config().vocab_size

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.data.seq_len

    def total_steps(self, n_params: int | None = None) -> int:
        """Optimizer steps: `train.steps`, or the token budget divided by tokens per step."""
        t = self.train
        if t.steps:
            return t.steps
        budget = t.tokens
        if t.tokens_per_param:
            if n_params is None:
                n_params = zoo.param_count(self.model_config())
            budget = int(t.tokens_per_param * n_params)
        return max(1, math.ceil(budget / self.tokens_per_step()))

    # Checks that span sections or read the outside world --------------------------------------

    @model_validator(mode="after")
    def _checked(self, info: ValidationInfo) -> Recipe:  # after pydantic's field checks
        self.check(inputs=(info.context or {}).get("inputs", True))
        return self

    def check(self, *, inputs: bool = True) -> None:
        """Checks that need several fields or the zoo (run at construction), and with `inputs`
        those of the data and tokenizer paths. Names the objective when the recipe leaves
        train.objective empty (`_resolve_objective`)."""
        self._resolve_objective()
        t, d = self.train, self.data
        for key, where in _FROM_TRAIN.items():
            if key in self.model.overrides:
                value = show(self.model.overrides[key])
                raise RecipeError(
                    f"model.overrides.{key}={value} is not allowed here: the recipe sets it from "
                    f"{where}; set {where} instead"
                )
        for key, value in self.model.overrides.items():
            if value is None:  # to_toml could not write it, and the run folder needs it
                raise RecipeError(
                    f"model.overrides.{key}=None: TOML has no null; leave {key} out to keep the "
                    "variant's value"
                )
        cfg = self.model_config()
        given = [
            f"{p}={show(getattr(t, p.split('.')[1]))}" for p in RUN_LENGTH if value_at(self, p)
        ]
        if len(given) != 1:
            what = " and ".join(given) if given else "no length of training"
            raise RecipeError(
                f"train: {what}; give exactly one of train.steps, train.tokens, "
                "train.tokens_per_param"
            )
        if t.batch_size % t.grad_accum:
            raise RecipeError(
                f"train.grad_accum={t.grad_accum} must divide train.batch_size={t.batch_size}"
            )
        rows = t.batch_size // t.grad_accum
        if rows % t.microbatches:
            raise RecipeError(
                f"train.microbatches={t.microbatches} must divide train.batch_size / grad_accum "
                f"= {rows} sequences per micro-batch"
            )
        prefix, staged = pipeline_layers(cfg)  # DeepSeek's dense prefix runs before the stages
        if staged % self.mesh.pipeline:
            what = f"n_layers={cfg.n_layers}" if not prefix else f"{staged} expert layers"
            raise RecipeError(
                f"mesh.pipeline={self.mesh.pipeline} must divide the model's {what}: each "
                "stage runs an equal, contiguous run of layers"
            )
        if d.seq_len > cfg.max_seq_len:
            raise RecipeError(
                f"data.seq_len={d.seq_len} must be at most the model's "
                f"max_seq_len={cfg.max_seq_len}"
            )
        if d.bpe_vocab_size and d.bpe_vocab_size < 257:
            raise RecipeError(
                f"data.bpe_vocab_size={d.bpe_vocab_size} must be 0 (the variant's vocab_size) "
                "or at least 257"
            )
        if d.reset_positions and not (d.document_mask or self.finetune.pack != "none"):
            raise RecipeError(
                "data.reset_positions=true restarts positions at each document, but no documents "
                "are marked: set data.document_mask=true (or finetune.pack for finetune.data)"
            )
        check_objective(self)
        check_finetune(self)
        check_plan(self)
        check_stability(self)
        if inputs:
            self.check_inputs()
        labels = set()
        for i, spec in enumerate(d.sources):
            key = f"data.sources[{i}]" + (f" ({spec.label!r})" if spec.label else "")
            if not spec.weight > 0:
                raise RecipeError(
                    f"{key}.weight={spec.weight} must be > 0: it is the source's share of the "
                    "training rows; remove the source or give it a positive weight"
                )
            label = source_label(spec, i)
            if label in labels:
                raise RecipeError(f"{key}: label {label!r} is used twice; give each a label")
            labels.add(label)
        last = 0
        for i, stage in enumerate(d.weight_schedule):
            key = f"data.weight_schedule[{i}]"
            if len(stage.weights) != len(d.sources) or not sum(stage.weights) > 0:
                raise RecipeError(
                    f"{key}.weights={list(stage.weights)} must hold one weight per data.sources "
                    f"entry ({len(d.sources)}), in that order, not all 0"
                )
            if stage.step <= last:
                raise RecipeError(
                    f"{key}.step={stage.step} must be above {last}: stages start at increasing "
                    "steps"
                )
            last = stage.step

    def check_inputs(self) -> None:
        """The data and tokenizer the recipe names exist (the outside world: a run folder's
        saved recipe is read without these checks)."""
        d = self.data
        check_data_files(self.finetune, self.preference, self.rl)
        check_tokenizer(d.tokenizer)
        check_source(d.source, "data.source")
        for i, spec in enumerate(d.sources):
            key = f"data.sources[{i}]" + (f" ({spec.label!r})" if spec.label else "")
            check_source(spec, key)
        for i, extra in enumerate(self.eval.extra_sources):
            check_source(extra, f"eval.extra_sources[{i}]")

    def _resolve_objective(self) -> None:
        """Fill train.objective (and preference.loss) of a recipe that leaves them empty: the
        objective is the one its data sections imply (`implied_objective`), so recipes and
        run folders written before train.objective existed read as they trained."""
        t, p = self.train, self.preference
        objective = t.objective or implied_objective(self)
        if objective in PREFERENCE_LOSSES and p.loss != objective:
            if p.loss:
                raise RecipeError(
                    f"train.objective={objective!r} and preference.loss={p.loss!r} disagree; "
                    "train.objective names the loss: drop preference.loss"
                )
            object.__setattr__(self, "preference", dataclasses.replace(p, loss=objective))
        if objective != t.objective:
            object.__setattr__(self, "train", dataclasses.replace(t, objective=objective))


_ADAPTER = TypeAdapter(Recipe)


# Plain-value editing (shared with load_recipe) -------------------------------------------------


def set_path(values: dict, path: str, value: Any) -> None:
    """Set `values[a][b] = value` for path "a.b", creating tables on the way."""
    parts = path.split(".")
    node = values
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{'.'.join(parts[: i + 1])} is not a table; cannot set {path}")
        node = child
    node[parts[-1]] = value


def clear_run_length(values: dict) -> None:
    """Remove train.steps, train.tokens and train.tokens_per_param from plain recipe values."""
    train = values.get("train")
    if isinstance(train, dict):
        for path in RUN_LENGTH:
            train.pop(path.split(".")[1], None)
