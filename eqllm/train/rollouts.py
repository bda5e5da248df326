"""GRPO rollouts: each prompt sampled `group_size` times with eqllm's compiled batched
generation, scored by a reward, and laid out as the GRPO objective's batch.

Rows are `width` tokens (prompt, completion, end-of-sequence padding) whatever the prompts, so
the train step compiles once; prompts are padded by `generate_batch` to a power-of-two bucket,
so generation compiles once per bucket. Keys are a function of (seed, step): a run's rollouts
are the same for the same seed and weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from eqllm.generation import generate_batch
from eqllm.model import CausalLM
from eqllm.train.grpo import group_advantages

Reward = Callable[[str, str, dict], float]


def rollout(
    model: CausalLM,
    prompts: Sequence[list[int]],
    examples: Sequence[dict],
    *,
    decode: Callable[[list[int]], str],
    reward: Reward,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    width: int,
    seed: int,
    step: int,
) -> dict[str, np.ndarray]:
    """The batch of `len(prompts) * group_size` completions: "tokens" [rows, width],
    "mask" [rows, width - 1] (the completion's targets, its end-of-sequence token included),
    "rewards" and "advantages" [rows] (standardised within each prompt's group)."""
    rows = [p for p in prompts for _ in range(group_size)]
    key = jax.random.fold_in(jax.random.key(seed), step)
    completions = generate_batch(
        model,
        rows,
        max_new_tokens=max_new_tokens,
        key=jax.random.split(key, len(rows)),
        temperature=temperature,
        stop_tokens=(eos_id,),
    )
    tokens = np.full((len(rows), width), eos_id, np.int64)
    mask = np.zeros((len(rows), width - 1), bool)
    rewards = np.zeros(len(rows), np.float32)
    for i, (prompt, new) in enumerate(zip(rows, completions, strict=True)):
        ids = list(prompt) + [int(t) for t in new]
        if len(ids) > width:
            raise ValueError(f"a rollout of {len(ids)} tokens does not fit the width {width}")
        tokens[i, : len(ids)] = ids
        mask[i, len(prompt) - 1 : len(ids) - 1] = True
        text = decode([int(t) for t in new if t != eos_id])
        example = examples[i // group_size]
        rewards[i] = float(reward(decode(list(prompt)), text, example))
    return {
        "tokens": tokens,
        "mask": mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_size),
    }
