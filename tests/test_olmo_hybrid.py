"""OLMo hybrid (`olmo_hybrid`): what the family contract (tests/test_families.py, entries
`olmo_hybrid` and `olmo_hybrid-nope`) does not cover. Its config.json read as transformers'
OlmoHybridConfig reads it (the default layer pattern, RoPE or none), and checkpoints with the
names of transformers' model (input_layernorm, one conv1d) and of the release (the convolution
cut at q, k and v) as well as those transformers' save_pretrained writes; packed documents with
pre-norm DeltaNet layers between post-norm attention layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from tests.families import TINY_CONFIGS
from tests.hf_parity import TOKENS, hf_logits, logits
from tests.test_segments import assert_each_document_alone, forward, packed_row

BASE = {
    "model_type": "olmo_hybrid",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "pad_token_id": None,
    "eos_token_id": None,
}


def _both(**hf):
    """eqllm's config and transformers' OlmoHybridConfig of one config.json."""
    transformers = pytest.importorskip("transformers")
    raw = {**BASE, **hf}
    theirs = transformers.OlmoHybridConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    return eqllm.hub.from_hf_config(raw), theirs


@pytest.mark.parametrize("n_layers, every", [(2, 2), (3, 3), (8, 4)])
def test_default_layer_types_are_transformers(n_layers, every):
    """Without layer_types, every fourth layer attends, or the last of fewer than four."""
    ours, theirs = _both(num_hidden_layers=n_layers)
    assert [f"{k}_attention" for k in ours.layer_kinds()] == theirs.layer_types
    assert ours.linear.full_every == every


def test_default_linear_sizes_are_transformers():
    ours, theirs = _both(num_hidden_layers=4)
    lin = ours.linear
    assert (lin.n_key_heads, lin.n_value_heads) == (4, 4)
    assert (lin.key_head_dim, lin.value_head_dim) == (
        theirs.linear_key_head_dim,
        theirs.linear_value_head_dim,
    )
    assert lin.allow_neg_eigval and lin.norm_eps == 1e-5 and lin.pre_norm


def test_rope_or_none_as_transformers_reads_it():
    """A null rope_theta is no RoPE (the 7B release); no rope settings at all is RoPE with
    base 10000, as transformers fills it in."""
    nope, _ = _both(num_hidden_layers=4, rope_parameters={"rope_theta": None})
    assert nope.positions.kind == "none"
    assert eqllm.hub.to_hf_config(nope)["rope_parameters"]["rope_theta"] is None
    plain, theirs = _both(num_hidden_layers=4)
    assert plain.positions.kind == "rope"
    assert plain.positions.theta == theirs.rope_parameters["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    "types",
    [
        ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        ["full_attention", "linear_attention"],
        ["linear_attention", "linear_attention", "full_attention", "full_attention"],
    ],
)
def test_layer_types_in_any_order_read_as_transformers_reads_them(types):
    """Not whole groups closed by an attention layer: read as `linear.pattern`
    (tests/test_layer_types.py), written back as they were."""
    ours, theirs = _both(num_hidden_layers=len(types), layer_types=types)
    assert [f"{k}_attention" for k in ours.layer_kinds()] == theirs.layer_types == types
    assert eqllm.hub.to_hf_config(ours)["layer_types"] == types


@pytest.mark.parametrize("conv", ["one", "qkv"])
def test_checkpoint_with_the_model_s_norm_names_imports(twins, tmp_path, conv):
    """A file with the norm names of transformers' model (input_layernorm and
    post_attention_layernorm) and one conv1d (the model's state dict), or the convolution cut
    at the q, k and v channels (the release's layout), reads with transformers' logits."""
    safetensors = pytest.importorskip("safetensors.torch")
    pair = twins("olmo_hybrid")
    state = {k: v.contiguous() for k, v in pair.hf.state_dict().items()}
    lin = pair.config.linear
    keys = lin.n_key_heads * lin.key_head_dim
    for name in [n for n in state if n.endswith("linear_attn.conv1d.weight")]:
        if conv == "qkv":
            whole = state.pop(name)
            pieces = whole.split([keys, keys, whole.shape[0] - 2 * keys])
            for part, piece in zip("qkv", pieces, strict=True):
                state[name.replace("conv1d", f"{part}_conv1d")] = piece.contiguous()
    assert any(n.endswith("input_layernorm.weight") for n in state)
    safetensors.save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((pair.folder / "config.json").read_text())
    model = eqllm.hub.from_pretrained(tmp_path)
    np.testing.assert_allclose(logits(model, TOKENS), hf_logits(pair.hf, TOKENS), atol=1e-4, rtol=0)


@pytest.mark.slow  # its own compiles; qwen3_5's twin of it runs by default (tests/test_hybrid.py)
def test_packed_documents_have_their_logits_alone():
    """Segment ids reset the DeltaNet state in the pre-norm layers and confine the post-norm
    attention layers (no RoPE: positions reach the model only through the recurrence)."""
    model = eqllm.CausalLM(TINY_CONFIGS["olmo_hybrid-nope"], key=jax.random.key(0))
    tokens, segments, positions = packed_row(1)
    packed = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segments)))
    assert_each_document_alone(model, packed, tokens)
