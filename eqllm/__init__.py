"""eqllm: decoder-only Transformer language models in JAX + Equinox."""
