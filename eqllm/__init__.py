"""eqllm: a model zoo of decoder-only Transformer language models in JAX + Equinox.

import jax, eqllm
model = eqllm.zoo.create("llama-nano", key=jax.random.key(0))
logits = model(tokens)            # Int[Array, "seq"] -> Float[Array, "seq vocab"]

Importing eqllm has no side effects, and loads each part on first use (`import eqllm.nn` loads
the layers and nothing of training, evaluation or the hub). A training program calls
`eqllm.configure_process()` first (before any JAX computation) to get the process settings the
`eqllm` command uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it; loaded on first access (PEP 562).
_EXPORTS = {
    "CausalLM": "eqllm.model",
    "ConfigError": "eqllm.config",
    "ModelConfig": "eqllm.config",
    "EqllmError": "eqllm.errors",
    "configure_process": "eqllm.hostmem",
    "generate": "eqllm.generation",
    "generate_batch": "eqllm.generation",
    "quantize": "eqllm.nn",
}

__all__ = [
    "CausalLM",
    "ConfigError",
    "EqllmError",
    "ModelConfig",
    "configure_process",
    "generate",
    "generate_batch",
    "hub",
    "lora",
    "nn",
    "quantize",
    "zoo",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from eqllm import hub, lora, nn, zoo
    from eqllm.config import ConfigError, ModelConfig
    from eqllm.errors import EqllmError
    from eqllm.generation import generate, generate_batch
    from eqllm.hostmem import configure_process
    from eqllm.model import CausalLM
    from eqllm.nn import quantize


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:  # a subpackage: eqllm.zoo, eqllm.hub, eqllm.nn, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'eqllm' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
