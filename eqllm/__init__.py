"""eqllm: a model zoo of decoder-only Transformer language models in JAX + Equinox.

import jax, eqllm
model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
logits = model(tokens)            # Int[Array, "seq"] -> Float[Array, "seq vocab"]
"""

from eqllm import hub, nn, zoo
from eqllm.config import ConfigError, ModelConfig
from eqllm.eval.generate import generate, generate_batch
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
