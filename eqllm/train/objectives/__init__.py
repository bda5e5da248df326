"""What a training step minimises: one module per objective, the step and the loop shared.

| `train.objective` | module | data | loss |
|---|---|---|---|
| "lm" | `lm` | data.source (or data.sources) | next-token cross entropy |
| "sft" | `sft` | finetune.data | cross entropy of the responses |
| "dpo", "ipo", "simpo" | `preference` | preference.data | the preference loss |
| "grpo" | `grpo` | rl.data | the clipped GRPO surrogate on rollouts |
| "distill" | `distill` | data.source, distill.teacher | KL to the teacher (+ cross entropy) |

Each is an `Objective` (`base`): its data, its batches, its loss, its evaluation and the names
of its metrics. `eqllm.train.step.TrainStep(objective=...)` reads its `loss(model, batch)`;
a mixture of experts' balance terms are added in one place (`eqllm.train.balance`). A new
objective is one module here, its name in `OBJECTIVES` and in `train.objective`'s values.
"""

from eqllm.train.objectives.base import (
    Objective,
    Run,
    base_tokenizer,
    routed_logps,
    sequence_logps,
    token_logps,
)
from eqllm.train.objectives.distill import Distill, distill_kl
from eqllm.train.objectives.grpo import Grpo, group_advantages, grpo_loss, rollout
from eqllm.train.objectives.lm import LanguageModel
from eqllm.train.objectives.preference import (
    Preference,
    preference_eval,
    preference_loss,
    reference_logps,
)
from eqllm.train.objectives.sft import Instructions

OBJECTIVES: dict[str, type[Objective]] = {
    "lm": LanguageModel,
    "sft": Instructions,
    "dpo": Preference,
    "ipo": Preference,
    "simpo": Preference,
    "grpo": Grpo,
    "distill": Distill,
}


def objective_class(name: str) -> type[Objective]:
    """The objective `train.objective` names."""
    return OBJECTIVES[name]


__all__ = [
    "OBJECTIVES",
    "Distill",
    "Grpo",
    "Instructions",
    "LanguageModel",
    "Objective",
    "Preference",
    "Run",
    "base_tokenizer",
    "distill_kl",
    "group_advantages",
    "grpo_loss",
    "objective_class",
    "preference_eval",
    "preference_loss",
    "reference_logps",
    "rollout",
    "routed_logps",
    "sequence_logps",
    "token_logps",
]
