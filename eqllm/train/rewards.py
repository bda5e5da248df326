"""Rewards for RL with verifiable rewards: a callable `(prompt, completion, example) -> float`.

`reward_of(spec, pattern, answer_field)` turns the recipe's `rl.reward` into one:

- "exact_match": 1.0 when the answer extracted from the completion equals `example[answer_field]`
  (both stripped), else 0.0. The answer is group 1 of `pattern` when it matches (its last
  match), else the completion's first line.
- "format": 1.0 when the regular expression `pattern` matches the completion (`re.search`).
- "reverse_digits": the toy task of the grpo-quickstart recipe (see `reverse_digits`).
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
BUILT_IN = ("exact_match", "format", "reverse_digits")


def extract_answer(completion: str, pattern: str = "") -> str:
    """The completion's answer: group 1 (or the whole match) of `pattern`'s last match, else the
    first line, stripped."""
    if pattern:
        matches = list(re.finditer(pattern, completion))
        if matches:
            m = matches[-1]
            return (m.group(1) if m.groups() else m.group(0)).strip()
    return completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""


def reverse_digits(prompt: str, completion: str, example: dict) -> float:
    """The share of `example["answer"]`'s characters the completion has in the same place
    (what follows the answer's length is not scored): 1.0 for the digits reversed."""
    target = str(example["answer"])
    got = completion.lstrip(" ")[: len(target)]
    return sum(a == b for a, b in zip(got, target, strict=False)) / max(len(target), 1)


def reward_of(spec: str, pattern: str = "", answer_field: str = "answer") -> Reward:
    """The reward the recipe's `rl.reward` names (see the module docstring)."""
    if spec == "exact_match":
        return lambda p, c, ex: float(extract_answer(c, pattern) == str(ex[answer_field]).strip())
    if spec == "format":
        if not pattern:
            raise RecipeError('rl.reward="format" needs rl.pattern, a regular expression')
        compiled = re.compile(pattern)
        return lambda p, c, ex: float(compiled.search(c) is not None)
    if spec == "reverse_digits":
        return reverse_digits
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


def write_reverse_digits(path: str | Path, n: int = 2000, *, digits: int = 3, seed: int = 0):
    """The grpo-quickstart data: `n` rows {"prompt": "x = 472\\ny = ", "answer": "274"}."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            number = "".join(str(d) for d in rng.integers(0, 10, digits))
            f.write(json.dumps({"prompt": f"x = {number}\ny = ", "answer": number[::-1]}) + "\n")
