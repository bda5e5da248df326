"""Recipes: every shipped recipe validates, every zoo variant has one, bad recipes fail early."""

import math

import jax
import numpy as np
import pytest

from eqllm import zoo
from eqllm.cli import main
from eqllm.recipe import OptimSpec, Recipe, RecipeError, load_recipe, parse_value, recipe_names
from eqllm.train.optim import decay_mask, schedule


@pytest.mark.parametrize("name", recipe_names())
def test_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    cfg = recipe.model_config()
    assert recipe.data.seq_len <= cfg.max_seq_len
    assert recipe.total_steps() >= 1
    # Writing the resolved recipe and reading it back gives the same recipe.
    assert Recipe.from_dict(__import__("tomllib").loads(recipe.to_toml())) == recipe


def test_every_zoo_variant_has_a_recipe():
    shipped = set(recipe_names())
    missing = [n for n in zoo.names() if n not in shipped]
    assert not missing, f"zoo variants without a recipe: {missing}"
    assert "quickstart" in shipped
    for name in zoo.names():
        assert load_recipe(name).model.variant == name


def test_research_recipes_default_to_twenty_tokens_per_parameter():
    recipe = load_recipe("llama-nano")
    n = zoo.param_count(recipe.model_config())
    tokens = recipe.total_steps() * recipe.tokens_per_step()
    assert 20 * n <= tokens < 20 * n + recipe.tokens_per_step()


def test_set_overrides_nested_fields_with_type_checks():
    recipe = load_recipe(
        "quickstart",
        ["train.steps=7", "optim.lr=1e-3", "data.source.max_bytes=1000", "model.overrides.d_ff=96"],
    )
    assert recipe.train.steps == 7 and recipe.optim.lr == 1e-3
    assert recipe.data.source.max_bytes == 1000
    assert recipe.model_config().d_ff == 96
    # An int where a float is expected is accepted and converted.
    assert load_recipe("quickstart", ["optim.lr=1"]).optim.lr == 1.0
    assert parse_value("[1, 2]") == [1, 2] and parse_value("hello") == "hello"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.stpes=3", "did you mean 'train.steps'"),
        ("train.batch_size=sixteen", "train.batch_size='sixteen' must be int"),
        ("train.precision=float64", "train.precision='float64' must be one of"),
        ("optim.schedule=exp", "optim.schedule='exp'"),
        ("model.variant=llama-nanoo", "did you mean llama-nano"),
        ("model.overrides.d_modle=3", "model.overrides"),
        ("data.source.kind=files", "needs `path`"),
        ('data.source={kind="files", path="/no/such/dir"}', "does not exist"),
        ("data.seq_len=100000", "data.seq_len=100000 must be at most"),
        ("train.grad_accum=3", "train.grad_accum=3 must divide train.batch_size=16"),
        ("train.tokens=1000", "give exactly one of"),
        ("data.tokenizer=./missing.json", "data.tokenizer"),
        ("eval.sample_prompts=3", "eval.sample_prompts=3 must be a list"),
        ("optim.lr=nan", "optim.lr"),
    ],
)
def test_bad_recipes_name_the_key(override, needle):
    with pytest.raises(RecipeError, match=None) as info:
        load_recipe("quickstart", [override])
    assert needle in str(info.value), str(info.value)


def test_missing_model_and_unknown_recipe():
    with pytest.raises(RecipeError, match="missing the required key 'model'"):
        Recipe.from_dict({"train": {"steps": 1}})
    with pytest.raises(FileNotFoundError, match="did you mean quickstart"):
        load_recipe("quikstart")


def test_cli_rejects_bad_recipe_before_compiling(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nvariant = "llama-nano"\n[train]\nsteps = 5\nbatchsize = 4\n')
    assert main(["run", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.batchsize" in err and "did you mean 'train.batch_size'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_then_decay_to_the_floor(kind):
    spec = OptimSpec(lr=1.0, warmup_steps=10, schedule=kind, min_lr_ratio=0.1)
    lr = [float(schedule(spec, 100)(s)) for s in range(101)]
    assert lr[0] == 0.0 and math.isclose(lr[10], 1.0, rel_tol=1e-6)
    assert all(a <= b + 1e-7 for a, b in zip(lr[:10], lr[1:11], strict=True))
    if kind == "constant":
        assert math.isclose(lr[99], 1.0, rel_tol=1e-6)
    else:
        assert math.isclose(lr[100], 0.1, rel_tol=1e-4), lr[95:]
    if kind == "wsd":  # flat until the last 20 % of the post-warmup steps
        assert math.isclose(lr[80], 1.0, rel_tol=1e-6) and lr[95] < 1.0


def test_weight_decay_mask_covers_linear_weights_only():
    import equinox as eqx
    from conftest import TINY_CONFIGS

    from eqllm import CausalLM

    model = CausalLM(TINY_CONFIGS["gpt2"], key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    mask = decay_mask(params)
    assert mask.blocks.attn.q_proj.weight is True and mask.blocks.mlp.up.weight is True
    assert mask.embed.weight is False and mask.blocks.attn.q_proj.bias is False
    assert mask.blocks.attn_norm.weight is False
    assert (
        np.ndim(params.blocks.attn_norm.weight) == 2
    )  # stacked: ndim alone cannot tell norms apart
