"""`eqllm plan`: a training run's step compiled for a TPU slice from a machine without a TPU.

    from eqllm.plan import plan_recipe, recipe_for, slice_devices
    from eqllm.sharding.tpu import parse_slice

    recipe, _ = recipe_for("llama3-8b")             # a recipe, or "zoo:NAME"
    tpu = parse_slice(recipe.plan.topology)         # "v5p-8": 4 chips
    plan = plan_recipe(recipe, tpu, slice_devices(tpu))
    plan.fits, plan.headroom, plan.roofline.mfu

`plan_recipe` compiles the step `eqllm run` would run (`eqllm.plan.step`) with the TPU compiler
and judges it against the chip (`Plan`); `eqllm.plan.roofline` estimates its time;
`eqllm.plan.search.search` is `--mesh auto`. Needs libtpu (`pip install "eqllm[tpu]"`).
"""

from eqllm.plan.devices import PlanError, attached_slice, install_command, slice_devices
from eqllm.plan.plan import HEADROOM, Plan, plan_recipe, recipe_for, with_settings
from eqllm.plan.roofline import Roofline
from eqllm.plan.search import Search, search

__all__ = [
    "HEADROOM",
    "Plan",
    "PlanError",
    "Roofline",
    "Search",
    "attached_slice",
    "install_command",
    "plan_recipe",
    "recipe_for",
    "search",
    "slice_devices",
    "with_settings",
]
