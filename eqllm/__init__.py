"""eqllm: a model zoo of decoder-only Transformer language models in JAX + Equinox.

import jax, eqllm
model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
logits = model(tokens)            # Int[Array, "seq"] -> Float[Array, "seq vocab"]
"""

# ruff: noqa: E402 (the malloc setting must come before the imports that start JAX)
from eqllm.hostmem import keep_freed_memory

keep_freed_memory()  # before anything starts JAX's CPU backend (see eqllm.hostmem)

from eqllm import hub, nn, zoo
from eqllm.config import ConfigError, ModelConfig
from eqllm.generation import generate, generate_batch
from eqllm.model import CausalLM

__all__ = [
    "CausalLM",
    "ConfigError",
    "ModelConfig",
    "generate",
    "generate_batch",
    "hub",
    "nn",
    "zoo",
]
__version__ = "0.1.0"
