"""What the transformers-parity tests share: a tiny perturbed transformers model, its logits,
eqllm's logits, and the saved-and-imported pair most of those tests start from.

Every parameter is perturbed so that a norm or bias mapped to the wrong place shows up in the
logits; the models are built by transformers itself from a config (no downloads).
"""

import types

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(spec: dict):
    """A transformers causal LM from `spec` (its `model_type` plus config fields), fp32, in eval
    mode, every parameter moved by N(0, 0.1) so that no norm is 1 and no bias 0."""
    spec = dict(spec)
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens) -> np.ndarray:
    """transformers' logits for one sequence, [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


@eqx.filter_jit
def forward(model, tokens):
    return model(tokens)


def logits(model, tokens) -> np.ndarray:
    """eqllm's logits for one sequence, compiled once per model structure."""
    return np.asarray(forward(model, jnp.asarray(tokens)))


def saved_pair(hf, folder, tokens, **extra) -> types.SimpleNamespace:
    """`hf` saved to `folder` and imported by eqllm: `.hf`, `.folder`, `.model` and `.ref`
    (transformers' logits of `tokens`), plus `extra`."""
    hf.save_pretrained(folder)
    model = eqllm.hub.from_pretrained(folder)
    return types.SimpleNamespace(
        hf=hf, folder=folder, model=model, ref=hf_logits(hf, tokens), **extra
    )
