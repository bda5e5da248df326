"""The recipe's checks that span sections: the objective against its data, fine-tuning and RL
against the model and the batch, the plan against its mesh (`Recipe.check` runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eqllm.recipe.errors import RecipeError
from eqllm.sharding import MeshError
from eqllm.sharding.tpu import TopologyError, parse_slice

if TYPE_CHECKING:
    from eqllm.recipe.spec import Recipe


def value_at(recipe: Recipe, path: str) -> Any:
    """The value at "section.key" of `recipe`."""
    section, key = path.split(".")
    return getattr(getattr(recipe, section), key)


def check_plan(recipe: Recipe) -> None:
    """plan.topology names a TPU slice, and a [mesh] without -1 covers its chips."""
    p = recipe.plan
    if not p.topology:
        return
    try:
        chips = parse_slice(p.topology, p.slices).chips
        recipe.mesh.resolve(chips)
    except TopologyError as e:
        raise RecipeError(f"plan.topology={p.topology!r}: {e}") from None
    except MeshError as e:
        raise RecipeError(f"mesh for plan.topology={p.topology!r} ({chips} chips): {e}") from None


def implied_objective(recipe: Recipe) -> str:
    """The objective a recipe without train.objective trains: GRPO with rl.data, the
    preference loss with preference.data, "sft" with finetune.data, else "lm"."""
    if recipe.rl.data:
        return "grpo"
    if recipe.preference.data:
        return recipe.preference.loss or "dpo"
    if recipe.finetune.data:
        return "sft"
    return "lm"


# What each objective reads: the section and key it needs, and the ones it leaves empty.
_NEEDS = {
    "lm": None,
    "sft": "finetune.data",
    "dpo": "preference.data",
    "ipo": "preference.data",
    "simpo": "preference.data",
    "grpo": "rl.data",
    "distill": "distill.teacher",
}


def check_objective(recipe: Recipe) -> None:
    """train.objective against the sections: the data it needs is given, no other's is."""
    objective = recipe.train.objective
    needs = _NEEDS[objective]
    if needs is not None and not value_at(recipe, needs):
        raise RecipeError(f"train.objective={objective!r} needs {needs}; set it")
    for other in ("finetune.data", "preference.data", "rl.data", "distill.teacher"):
        if other != needs and value_at(recipe, other):
            raise RecipeError(
                f"{other}={value_at(recipe, other)!r} with train.objective={objective!r}: a run "
                f"trains one objective; leave {other} empty"
                + ("" if objective != "lm" else " or set train.objective")
            )


def check_stability(recipe: Recipe) -> None:
    """optim.z_loss only where the loss is the language model's cross entropy."""
    objective = recipe.train.objective
    if recipe.optim.z_loss and objective not in ("lm", "sft"):
        raise RecipeError(
            f"optim.z_loss={recipe.optim.z_loss:g} with train.objective={objective!r}: z-loss is "
            "added to the language model's cross entropy (objectives 'lm' and 'sft'); remove it"
        )


def check_rl(recipe: Recipe) -> None:
    r = recipe.rl
    if not r.data:
        return
    if not recipe.model.init_from:
        raise RecipeError(
            f"rl.data={r.data!r} needs model.init_from: the starting model (and its tokenizer) "
            "that RL improves"
        )
    if recipe.train.batch_size % r.group_size:
        raise RecipeError(
            f"rl.group_size={r.group_size} must divide train.batch_size="
            f"{recipe.train.batch_size} (the completions per step)"
        )
    if r.max_new_tokens >= recipe.data.seq_len:
        raise RecipeError(
            f"rl.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in "
            f"data.seq_len={recipe.data.seq_len}; raise data.seq_len"
        )


def check_finetune(recipe: Recipe) -> None:
    check_rl(recipe)
    f, p = recipe.finetune, recipe.preference
    if p.data:
        if f.method == "none":
            raise RecipeError(
                f"preference.data={p.data!r} needs finetune.method 'lora' or 'full': the "
                "reference is the starting model model.init_from"
            )
    if f.method != "none" and not recipe.model.init_from:
        raise RecipeError(
            f"finetune.method={f.method!r} needs a base: set model.init_from to a Hugging Face "
            "folder or hub repo id, or an eqllm run folder"
        )
    if f.method == "lora" and recipe.optim.name == "muon":
        raise RecipeError(
            'optim.name="muon" with finetune.method="lora": one axis of each adapter matrix is '
            "the rank, not a width, so Muon would take none of them and every adapter would "
            'train with AdamW; set optim.name="adamw"'
        )
