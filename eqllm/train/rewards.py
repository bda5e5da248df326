"""Rewards for RL with verifiable rewards: a callable `(prompt, completion, example) -> float`.

`reward_of(spec, pattern, answer_field)` turns the recipe's `rl.reward` into one:

- "exact_match": 1.0 when the answer extracted from the completion equals `example[answer_field]`
  (both stripped), else 0.0. The answer is group 1 of `pattern` when it matches (its last
  match), else the completion's first line.
- "format": 1.0 when the regular expression `pattern` matches the completion (`re.search`).
- "close_brackets": the toy task of the grpo-quickstart recipe (see `close_brackets`).
- "module:function": any importable callable with that signature.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from eqllm.recipe import RecipeError

Reward = Callable[[str, str, dict], float]
BUILT_IN = ("exact_match", "format", "close_brackets")


def extract_answer(completion: str, pattern: str = "") -> str:
    """The completion's answer: group 1 (or the whole match) of `pattern`'s last match, else the
    first line, stripped."""
    if pattern:
        matches = list(re.finditer(pattern, completion))
        if matches:
            m = matches[-1]
            return (m.group(1) if m.groups() else m.group(0)).strip()
    return completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""


def close_brackets(prompt: str, completion: str, example: dict) -> float:
    """The share of `example["answer"]` (the brackets that close the prompt's line, innermost
    first, e.g. "])") followed by the line's end that the completion has in the same place:
    1.0 for exactly the closing brackets, then a newline; partial credit for a right start.
    """
    target = str(example["answer"]) + "\n"
    line, newline, _ = completion.partition("\n")
    got = line.rstrip(" ") + newline
    right = 0
    for a, b in zip(got, target, strict=False):
        if a != b:
            break
        right += 1
    return right / len(target)


def reward_of(spec: str, pattern: str = "", answer_field: str = "answer") -> Reward:
    """The reward the recipe's `rl.reward` names (see the module docstring)."""
    if spec == "exact_match":
        return lambda p, c, ex: float(extract_answer(c, pattern) == str(ex[answer_field]).strip())
    if spec == "format":
        if not pattern:
            raise RecipeError('rl.reward="format" needs rl.pattern, a regular expression')
        compiled = re.compile(pattern)
        return lambda p, c, ex: float(compiled.search(c) is not None)
    if spec == "close_brackets":
        return close_brackets
    module, _, name = spec.partition(":")
    if not module or not name:
        raise RecipeError(f"rl.reward={spec!r} is not one of {list(BUILT_IN)} or 'module:function'")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"rl.reward={spec!r} cannot be loaded ({e}); check the name") from None
    if not callable(function):
        raise RecipeError(f"rl.reward={spec!r} is not callable")
    return function


_NAMES = (
    "count value name size path data item key index timeout parent child buffer offset width "
    "height label level state mode owner target source result total limit order page text line "
    "file node"
).split()
_FUNCTIONS = "len max min sum abs int str list sorted tuple repr format".split()
_OPERATORS = (" + ", " - ", " * ", ", ")


def close_brackets_example(rng: np.random.Generator, depth: int) -> dict:
    """One line of Python left open `depth` brackets deep (calls, subscripts, parentheses):
    {"prompt": "size = len(items[offset + (count", "answer": ")])"}."""
    line, closers = "", []
    for level in range(depth):
        if level:
            line += rng.choice(_NAMES) + rng.choice(_OPERATORS)
        kind = rng.integers(3)
        if kind == 0:
            line, closers = line + rng.choice(_FUNCTIONS) + "(", [*closers, ")"]
        elif kind == 1:
            line, closers = line + rng.choice(_NAMES) + "[", [*closers, "]"]
        else:
            line, closers = line + "(", [*closers, ")"]
    line += rng.choice(_NAMES) if rng.random() < 0.7 else str(rng.integers(10))
    return {"prompt": f"{rng.choice(_NAMES)} = {line}", "answer": "".join(reversed(closers))}


def write_close_brackets(path: str | Path, n: int = 2000, *, max_depth: int = 3, seed: int = 0):
    """The grpo-quickstart data: `n` distinct rows of `close_brackets_example`, depths 1 to
    `max_depth` in turn."""
    rng = np.random.default_rng(seed)
    rows: dict[str, dict] = {}  # by prompt: no prompt twice, so a held-out split is unseen
    while len(rows) < n:
        row = close_brackets_example(rng, 1 + len(rows) % max_depth)
        rows.setdefault(row["prompt"], row)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows.values())
