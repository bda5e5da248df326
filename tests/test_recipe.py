"""Recipes: every shipped recipe validates, every zoo variant has one, bad recipes fail early."""

import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import tomllib

from eqllm import zoo
from eqllm.cli import main
from eqllm.recipe import OptimSpec, Recipe, RecipeError, load_recipe, parse_value, recipe_names
from eqllm.sharding import check_divisible
from eqllm.sharding.tpu import parse_slice
from eqllm.train.optim import decay_mask, schedule
from eqllm.train.setup import check_batch_split


@pytest.mark.parametrize("name", recipe_names())
def test_shipped_recipe_validates(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    cfg = recipe.model_config()
    assert recipe.data.seq_len <= cfg.max_seq_len
    assert recipe.total_steps() >= 1
    # Writing the resolved recipe and reading it back gives the same recipe.
    assert Recipe.from_dict(tomllib.loads(recipe.to_toml())) == recipe
    if recipe.plan.topology:  # its mesh splits the model and the batch on the slice it names
        chips = parse_slice(recipe.plan.topology, recipe.plan.slices).chips
        sizes = recipe.mesh.axis_sizes(chips)
        check_divisible(cfg, sizes)
        check_batch_split(recipe, SimpleNamespace(shape=sizes))


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
        [
            "train.steps=7",
            "optim.lr=1e-3",
            "data.source.max_bytes=1000",
            "model.overrides.mlp.d_ff=96",
        ],
    )
    assert recipe.train.steps == 7 and recipe.optim.lr == 1e-3
    assert recipe.data.source.max_bytes == 1000
    assert recipe.model_config().mlp.d_ff == 96
    # An int where a float is expected is accepted and converted.
    assert load_recipe("quickstart", ["optim.lr=1"]).optim.lr == 1.0
    assert parse_value("[1, 2]") == [1, 2] and parse_value("hello") == "hello"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.stpes=3",
            "unknown key 'train.stpes' in train; did you mean 'train.steps'? allowed: batch_size, ",
        ),
        ("train.batch_size=sixteen", "train.batch_size='sixteen' must be int"),
        ("train.batch_size=16.0", "train.batch_size=16.0 must be int"),
        ("train.batch_size=0", "train.batch_size=0 must be positive"),
        ("train.steps=-3", "train.steps=-3 must be >= 0"),
        (
            "train.precision=float64",
            "train.precision='float64' must be one of 'float32', 'bfloat16'",
        ),
        ("train.remat=some", "train.remat='some' must be one of 'none', 'full', 'dots', 'dots_no"),
        ("optim.schedule=exp", "optim.schedule='exp' must be one of 'cosine', 'linear', "),
        ("optim.lr=nan", "optim.lr=nan must be a finite number"),
        ("optim.lr=true", "optim.lr=True must be float"),
        ("optim.b1=1.5", "optim.b1=1.5 must be in [0, 1)"),
        ("optim.decay_fraction=0", "optim.decay_fraction=0 must be in (0, 1]"),
        (
            "model.variant=llama-nanoo",
            "model.variant: unknown zoo model 'llama-nanoo'; did you mean",
        ),
        (
            "model.overrides.d_modle=3",
            "model.overrides: unknown ModelConfig field 'd_modle'; did you mean 'd_model'?",
        ),
        ("model.overrides.d_model=-8", "model.overrides: ModelConfig.d_model=-8 must be positive"),
        ("data.source.kind=files", "data.source: DataSource(kind='files') needs `path`"),
        (
            'data.source={kind="files", path="/no/such/dir"}',
            "data.source.path='/no/such/dir' does not exist",
        ),
        ("data.source.max_bytes=-1", "data.source.max_bytes=-1 must be >= 0"),
        ("data.seq_len=100000", "data.seq_len=100000 must be at most the model's max_seq_len=128"),
        ("data.val_fraction=1", "data.val_fraction=1 must be in [0, 1)"),
        ("train.grad_accum=3", "train.grad_accum=3 must divide train.batch_size=16"),
        ("train.steps=0", "train: no length of training; give exactly one of train.steps, "),
        ("data.tokenizer=./missing.json", "data.tokenizer='./missing.json' is not 'bytes', 'bpe'"),
        ("eval.sample_prompts=3", "eval.sample_prompts=3 must be a list"),
        ('eval.sample_prompts=["a", 2]', "eval.sample_prompts[1]=2 must be str"),
        (
            'eval.extra_sources=[{kind="stdlib", pth="x"}]',
            "unknown key 'eval.extra_sources[0].pth' in eval.extra_sources[0]; did you mean "
            "'eval.extra_sources[0].path'?",
        ),
        ("mesh.data=0", "mesh.data=0 must be a positive integer or -1"),
        ("mesh.data=2.0", "mesh.data=2.0 must be a positive integer or -1"),
        ("mesh.dta=2", "unknown key 'mesh.dta' in mesh; did you mean 'mesh.data'?"),
        ("train=3", "train=3 must be a table"),
        (
            'model.overrides={mlp={d_ff=[1, "a"]}}',
            'model.overrides: ModelConfig.mlp.d_ff=[1, "a"] must be int',
        ),
        ("zzz=1", "unknown key 'zzz' in the recipe; allowed: model, data, optim, train, eval"),
    ],
)
def test_bad_recipes_name_the_key_the_value_and_the_rule(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe("quickstart", [override])
    assert str(info.value).startswith(f"quickstart.toml: {message}"), str(info.value)
    assert "\n" not in str(info.value)


def test_missing_model_and_unknown_recipe():
    with pytest.raises(RecipeError, match="^the recipe is missing the required key 'model'$"):
        Recipe.from_dict({"train": {"steps": 1}})
    with pytest.raises(RecipeError, match="^model is missing the required key 'model.variant'$"):
        Recipe.from_dict({"model": {}, "train": {"steps": 1}})
    with pytest.raises(RecipeError, match="^the recipe must be a table, got 5$"):
        Recipe.from_dict(5)
    with pytest.raises(RecipeError, match="did you mean quickstart"):
        load_recipe("quikstart")


def test_sections_built_directly_name_their_class():
    assert OptimSpec(lr=1).lr == 1.0
    with pytest.raises(RecipeError, match=r"^OptimSpec.lr=-1.0 must be positive$"):
        OptimSpec(lr=-1.0)
    with pytest.raises(RecipeError, match="unknown key 'OptimSpec.lrr' in OptimSpec; did you mean"):
        OptimSpec(lrr=1.0)


def test_set_of_one_run_length_replaces_the_recipes():
    """llama-micro gives tokens_per_param; --set train.steps=20 replaces it rather than clash."""
    assert load_recipe("llama-micro").train.tokens_per_param == 20
    recipe = load_recipe("llama-micro", ["train.steps=20"])
    assert (recipe.train.steps, recipe.train.tokens, recipe.train.tokens_per_param) == (20, 0, 0)
    assert recipe.total_steps() == 20
    recipe = load_recipe("quickstart", ["train.tokens=4096"])
    assert recipe.train.steps == 0 and recipe.total_steps() == 2  # 4096 / (16 * 128)
    assert recipe.replace("train.steps", 5).train.tokens == 0  # Recipe.replace does the same
    # Two lengths given together are still an error, naming both and the rule.
    with pytest.raises(RecipeError) as info:
        load_recipe("quickstart", ["train.steps=5", "train.tokens=100"])
    assert str(info.value) == (
        "quickstart.toml: train: train.steps=5 and train.tokens=100; give exactly one of "
        "train.steps, train.tokens, train.tokens_per_param"
    )
    values = load_recipe("quickstart").to_dict()
    values["train"] = {"steps": 300, "tokens": 100}
    with pytest.raises(RecipeError, match="train.steps=300 and train.tokens=100; give exactly"):
        Recipe.from_dict(values)


@pytest.mark.parametrize(
    "key, where", [("remat", "train.remat"), ("compute_dtype", "train.precision")]
)
def test_model_overrides_may_not_set_what_train_sets(key, where):
    """train.remat / train.precision are the one place for these; an override would be ignored."""
    with pytest.raises(RecipeError) as info:
        load_recipe("quickstart", [f'model.overrides.{key}="full"'])
    message = str(info.value)
    assert f"model.overrides.{key}='full' is not allowed here" in message
    assert f"set {where} instead" in message
    cfg = load_recipe("quickstart", ["train.remat=dots", "train.precision=bfloat16"]).model_config()
    assert (cfg.remat, cfg.compute_dtype) == ("dots", "bfloat16")


def test_model_overrides_cannot_hold_none():
    """A recipe must write back to TOML (the run folder's config.toml), which has no null."""
    values = load_recipe("quickstart").to_dict()
    values["model"]["overrides"]["final_softcap"] = None
    with pytest.raises(RecipeError, match=r"^model.overrides.final_softcap=None: TOML has no"):
        Recipe.from_dict(values)


def test_to_toml_round_trips_every_field():
    recipe = load_recipe(
        "quickstart",
        [
            'eval.extra_sources=[{kind="stdlib", label="more"}]',
            "mesh.fsdp=2",
            'description="a\\nb"',
        ],
    )
    assert recipe.description == "a\nb" and recipe.mesh.fsdp == 2
    assert Recipe.from_dict(tomllib.loads(recipe.to_toml())) == recipe
    assert recipe.to_dict()["eval"]["sample_prompts"] == list(recipe.eval.sample_prompts)


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
