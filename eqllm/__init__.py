"""eqllm: a model zoo of decoder-only Transformer language models in JAX + Equinox.

import jax, eqllm
model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
logits = model(tokens)            # Int[Array, "seq"] -> Float[Array, "seq vocab"]

Importing eqllm has no side effects. A training program calls `eqllm.configure_process()` first
(before any JAX computation) to get the process settings the `eqllm` command uses.
"""

from eqllm import hub, nn, zoo
from eqllm.config import ConfigError, ModelConfig
from eqllm.errors import EqllmError
from eqllm.eval.generate import generate, generate_batch
from eqllm.hostmem import configure_process
from eqllm.model import CausalLM

__all__ = [
    "CausalLM",
    "ConfigError",
    "EqllmError",
    "ModelConfig",
    "configure_process",
    "generate",
    "generate_batch",
    "hub",
    "nn",
    "zoo",
]
__version__ = "0.1.0"
