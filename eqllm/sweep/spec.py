"""Sweep files: a base recipe, fixed overrides and the points (a grid or an explicit list).

```toml
recipe = "quickstart"              # a shipped recipe name or a path (relative to this file)
diverge_factor = 1.1               # a point diverges when its loss exceeds this x its first loss
[set]                              # overrides every point gets
"train.steps" = 200
[grid]                             # every combination, the first key varying slowest
"optim.lr" = [0.0625, 0.03125]
"model.overrides.d_model" = [64, 128]
# or, instead of (or after) the grid: [[points]] tables, each a table of overrides
```

Keys are recipe paths, as `eqllm run --set` takes them. Point i is the i-th combination of the
grid (then the explicit points in order) and runs in the folder `<out>/<i:03d>`.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from eqllm.errors import EqllmError
from eqllm.recipe import Recipe, load_recipe, recipe_path
from eqllm.recipe.spec import RUN_LENGTH, clear_run_length, set_path

KEYS = ("recipe", "set", "grid", "points", "diverge_factor")
# A point diverges when a training loss exceeds this x its first step's loss. Not 1.0: at the
# start of a warmup the loss wanders around its initial value by batch noise (a demo sweep of
# the quickstart recipe stopped every point at step 2 with 1.0).
DIVERGE_FACTOR = 1.1


class SweepError(EqllmError):
    """A sweep file or a sweep folder that cannot be used as given."""


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its index, folder name and overrides (recipe path -> value)."""

    index: int
    settings: dict[str, Any] = field(hash=False)

    @property
    def name(self) -> str:
        return f"{self.index:03d}"


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file."""

    path: Path
    recipe: str  # the base recipe: a shipped name or a path
    fixed: dict[str, Any]
    points: tuple[Point, ...]
    diverge_factor: float = 1.1

    @property
    def name(self) -> str:
        return self.path.stem

    def point_recipe(self, point: Point) -> Recipe:
        """The base recipe with [set] and the point's overrides applied (checked)."""
        base = load_recipe(self.recipe)
        values = base.to_dict()
        overrides = {**self.fixed, **point.settings}
        if any(key in RUN_LENGTH for key in overrides):
            clear_run_length(values)
        for key, value in overrides.items():
            set_path(values, key, value)
        values["name"] = f"{self.name}/{point.name}"
        try:
            return Recipe.from_dict(values)
        except EqllmError as e:
            raise SweepError(f"{self.path.name} point {point.name} {point.settings}: {e}") from None


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    i, sep, n = text.partition("/")
    try:
        shard, count = int(i), int(n)
    except ValueError:
        shard = count = -1
    if not sep or count < 1 or not 0 <= shard < count:
        raise SweepError(f"--shard {text!r} must be I/N with 0 <= I < N, e.g. 0/4")
    return shard, count


def shard_points(points: tuple[Point, ...], shard: int, count: int) -> tuple[Point, ...]:
    """Every `count`-th point starting at `shard`: the shards of one sweep partition it."""
    return tuple(p for p in points if p.index % count == shard)


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep file (every point's recipe is built once, so a bad value in any
    point fails here, before the first point runs)."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {str(path)!r} does not exist; check the path")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    unknown = [k for k in values if k not in KEYS]
    if unknown:
        raise SweepError(f"{path.name}: unknown key {unknown[0]!r}; a sweep file has {KEYS}")
    recipe = values.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise SweepError(f'{path.name}: recipe must name a recipe, e.g. recipe = "quickstart"')
    beside = path.parent / recipe
    if recipe.endswith(".toml") and beside.is_file():
        recipe = str(beside)
    recipe_path(recipe)  # a missing recipe fails now, with close names
    fixed = _table(values.get("set", {}), "set", path)
    grid = _table(values.get("grid", {}), "grid", path)
    for key, options in grid.items():
        if not isinstance(options, list) or not options:
            raise SweepError(f"{path.name}: grid.{key} must be a non-empty list of values")
    listed = values.get("points", [])
    if not isinstance(listed, list) or not all(isinstance(p, dict) for p in listed):
        raise SweepError(f"{path.name}: points must be [[points]] tables of overrides")
    combos = [dict(zip(grid, c, strict=True)) for c in itertools.product(*grid.values())]
    if not grid:
        combos = []
    settings = combos + [flatten(p) for p in listed]
    if not settings:
        raise SweepError(f"{path.name}: no points; give a [grid] table or [[points]] tables")
    factor = values.get("diverge_factor", DIVERGE_FACTOR)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise SweepError(f"{path.name}: diverge_factor={factor!r} must be a number >= 1")
    if not math.isfinite(factor):
        raise SweepError(f"{path.name}: diverge_factor={factor!r} must be finite")
    sweep = Sweep(
        path=path,
        recipe=recipe,
        fixed=fixed,
        points=tuple(Point(i, s) for i, s in enumerate(settings)),
        diverge_factor=float(factor),
    )
    for point in sweep.points:
        sweep.point_recipe(point)
    return sweep


def _table(value: Any, name: str, path: Path) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SweepError(f"{path.name}: [{name}] must be a table of recipe keys")
    return flatten(value)


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys for nested tables: TOML reads `train.steps = 1` as {"train": {"steps": 1}},
    `"train.steps" = 1` as {"train.steps": 1}; both mean the recipe path train.steps."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
