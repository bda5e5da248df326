"""What the transformers-parity tests share: a tiny perturbed transformers model, its logits,
eqllm's logits, the saved-and-imported pair most of those tests start from, and the twin of each
entry of tests/families.py (built once per session: the `twins` fixture in tests/conftest.py).

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
    mode, every parameter and every buffer its checkpoint stores (DeepSeek-V3's correction bias)
    moved by N(0, 0.1) so that no norm is 1 and no bias 0."""
    spec = dict(spec)
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stored = model.state_dict().keys()
    buffers = [b for n, b in model.named_buffers() if n in stored and b.is_floating_point()]
    with torch.no_grad():
        for p in [*model.parameters(), *buffers]:
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


# The twins: each entry of tests/families.py and transformers' model of the same config.
CONTEXT = 256
TOKENS = np.random.default_rng(0).integers(0, 97, 240)  # hundreds: short inputs miss RoPE errors


def twin(tiny, folder) -> types.SimpleNamespace:
    """The transformers model of `tiny`'s config (its context widened to CONTEXT), perturbed,
    saved to `folder` and imported by eqllm: `saved_pair`'s fields plus `.tiny` and `.config`,
    the config eqllm should read back (scanned, the wider context)."""
    config = tiny.config.replace(max_seq_len=CONTEXT, scan_layers=True)
    hf = hf_model(eqllm.hub.to_hf_config(config))
    return saved_pair(hf, folder, TOKENS, name=tiny.name, tiny=tiny, config=config)


def check_greedy_generate(pair, new: int = 24) -> None:
    """eqllm.generate's greedy continuation of TOKENS[:9] is the one transformers' `generate`
    picks, for a (model, hf) pair of twins."""
    import jax
    import torch

    prompt = [int(t) for t in TOKENS[:9]]
    ours = eqllm.generate(
        pair.model, prompt, max_new_tokens=new, key=jax.random.key(0), temperature=0
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = pair.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out[0, len(prompt) :].tolist() == np.asarray(ours).tolist()
