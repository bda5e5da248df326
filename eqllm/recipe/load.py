"""Finding and reading recipe files, with `--set key=value` overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomllib

from eqllm.errors import did_you_mean
from eqllm.recipe.errors import RecipeError
from eqllm.recipe.spec import RUN_LENGTH, Recipe, clear_run_length, set_path
from eqllm.resources import data_dir


def recipe_names() -> list[str]:
    """The recipes shipped in recipes/ (without .toml)."""
    return sorted(p.stem for p in data_dir("recipes").glob("*.toml"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """A path to a .toml file, or the shipped recipe of that name; unknown names list close ones."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist; check the path")
        return path
    shipped = data_dir("recipes") / f"{name_or_path}.toml"
    if shipped.is_file():
        return shipped
    names = recipe_names()
    hint = did_you_mean(str(name_or_path), names)
    raise RecipeError(
        f"no recipe named {str(name_or_path)!r}; {hint}shipped recipes: {', '.join(names)} "
        "(or give a path to a .toml file)"
    )


def load_recipe(
    name_or_path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()
) -> Recipe:
    """Read a recipe by shipped name or path, apply `key=value` overrides, validate it all.

    An override of train.steps, train.tokens or train.tokens_per_param replaces the length of
    training the file gives (the file's other two are dropped).
    """
    path = recipe_path(name_or_path)
    try:
        with path.open("rb") as f:
            values = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None
    values.setdefault("name", path.stem)
    apply_overrides(values, overrides)
    try:
        return Recipe.from_dict(values)
    except RecipeError as e:
        raise RecipeError(f"{path.name}: {e}") from None


def apply_overrides(values: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """Apply `key=value` overrides to plain recipe values, in place.

    An override of train.steps, train.tokens or train.tokens_per_param replaces the length of
    training the values give (the other two are dropped).
    """
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not all(part.strip() for part in key.split(".")):
            raise RecipeError(
                f"--set {item!r}: expected key=value with a dotted key, e.g. train.steps=100"
            )
        parsed.append((key.strip(), parse_value(text.strip())))
    if any(key in RUN_LENGTH for key, _ in parsed):
        clear_run_length(values)
    for key, value in parsed:
        set_path(values, key, value)


def parse_value(text: str) -> Any:
    """A --set value: a TOML literal (100, 3e-4, true, "x", [1, 2], {a = 1}) or a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
