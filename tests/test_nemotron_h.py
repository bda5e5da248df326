"""Nemotron-H (`nemotron_h`): layers of one sublayer each, Mamba-2 ("linear"), attention alone
("full" with `linear.full_mlp` False) and the MLP alone (kind "ffn").

The family contract (tests/test_families.py, entry `nemotron_h`) checks logits against
transformers both ways, peft's LoRA both ways, scanned == unrolled, cached decoding == the full
forward and greedy generation == transformers' `generate`, and the 56B's published count. Here:
the stacks the kinds build, packed documents equal each alone, the FLOPs against the weights,
the pattern's spellings in config.json (and the refusal of a pattern mixing MLP and expert
layers; the experts themselves: tests/test_nemotron_h_moe.py), and the segments the
published patterns are cut into (compile time follows their number).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config import ConfigError
from eqllm.config.kinds import segments, stack_layers
from eqllm.nn import Linear, Mamba2
from eqllm.serve import Engine
from eqllm.sharding.rules import logical_axes
from tests.engine_runs import full_forward_logprobs, random_prompts, run_requests
from tests.families import TINY_CONFIGS
from tests.test_mamba2_generation import _perturbed
from tests.test_segments import assert_each_document_alone, forward, packed_row

CONFIG = TINY_CONFIGS["nemotron_h"]  # Mamba-2, MLP, attention, MLP, Mamba-2
SYMBOLS = {"M": "linear", "*": "full", "-": "ffn"}


@pytest.fixture(scope="module")
def model():
    return eqllm.CausalLM(CONFIG, key=jax.random.key(0))


def test_each_kind_is_one_sublayer_in_its_own_stack(model):
    assert CONFIG.layer_kinds() == ("linear", "ffn", "full", "ffn", "linear")
    assert stack_layers(CONFIG) == {
        "linear_blocks": (0, 4),
        "ffn_blocks": (1, 3),
        "blocks": (2,),
    }
    assert isinstance(model.linear_blocks.attn, Mamba2) and model.linear_blocks.mlp is None
    assert model.blocks.mlp is None and model.blocks.mlp_norm is None  # attention alone
    ffn = model.ffn_blocks
    assert ffn.attn is None and ffn.attn_norm is None and ffn.mlp.relu2
    axes = logical_axes(model)
    assert axes["ffn_blocks.mlp.up.weight"] == ("layers", "d_ff", "d_model")
    assert axes["ffn_blocks.mlp_norm.weight"][0] == "layers"


def test_packed_documents_have_their_logits_alone(model):
    """Segment ids reset the Mamba-2 state and keep attention inside each document."""
    tokens, segment_ids, positions = packed_row(2)
    logits_ = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segment_ids)))
    assert_each_document_alone(model, logits_, tokens)


def test_flops_count_every_projection_once(model):
    """6 x (every projection's weights + the head) + the one attention layer's scores."""
    weights = sum(
        leaf.weight.size
        for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, Linear))
        if isinstance(leaf, Linear)
    )
    a = CONFIG.attention
    scores = 6.0 * 1 * a.n_heads * 2 * a.head_dim * CONFIG.max_seq_len
    assert CONFIG.attention_flops_per_token() == scores
    assert CONFIG.flops_per_token() == 6.0 * weights + scores


def _hf(**layers):
    hf = eqllm.hub.to_hf_config(CONFIG)
    hf.pop("layers_block_type")
    return {**hf, **layers}


@pytest.mark.parametrize(
    "spelling",
    [
        {"hybrid_override_pattern": "M-*-M"},
        {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp", "mamba"]},
        {"layer_types": ["mamba", "mlp", "attention", "mlp", "linear_attention"]},
    ],
)
def test_every_spelling_of_the_pattern_reads_the_same_layers(spelling):
    assert eqllm.hub.from_hf_config(_hf(**spelling)) == CONFIG


@pytest.mark.parametrize(
    "spelling, message",
    [
        ({"hybrid_override_pattern": "M-*E"}, "both 'mlp' and 'moe' layers"),
        ({"layers_block_type": ["mamba", "cross_attention"]}, "are not Nemotron-H's"),
        ({}, "must set layers_block_type"),
    ],
)
def test_mixed_feed_forward_kinds_and_unknown_layers_are_refused_by_name(spelling, message):
    with pytest.raises(ConfigError, match=message):
        eqllm.hub.from_hf_config(_hf(**spelling))


@pytest.mark.parametrize(
    "pattern, expected",
    [
        # Nemotron-H-8B and -4B: (M-M-M-M*-M-) x 4, then (M-) x 4.
        ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 2),
        # Nemotron-H-56B: the same period x 10, then (M-) x 4.
        ("M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-", 2),
        # NVIDIA-Nemotron-Nano-9B-v2: irregular, nine segments.
        ("M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", 9),
    ],
)
def test_published_patterns_are_cut_into_few_segments(pattern, expected):
    kinds = tuple(SYMBOLS[c] for c in pattern)
    got = segments(kinds)
    assert len(got) == expected
    assert tuple(k for s in got for _ in range(s.repeats) for k in s.pattern) == kinds


def test_completep_export_folds_the_branch_multiplier_into_every_stack(tmp_path):
    """CompleteP's branch multiplier (base_n_layers 2 of 5 layers) lands in the Mamba-2
    out_proj, attention's o_proj and the MLP's down_proj: transformers computes the same."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CONFIG.replace(parametrization="completep", base_n_layers=2)
    model = eqllm.CausalLM(cfg, key=jax.random.key(3))
    eqllm.hub.save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 97, 32)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens[None])).logits[0].numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(jnp.asarray(tokens))), atol=1e-4)


@pytest.mark.slow
def test_the_engine_equals_generate_and_the_full_forward(model):
    """Four sampled requests over two slots of the serving engine: the Mamba-2 layers carry
    their state by slot, the attention layer its pages, the MLP layers nothing (their cache
    entry is None). Each request equals `eqllm.generate` and the full forward's
    log-probabilities."""
    model = _perturbed(model, jax.random.key(4))
    prompts, new = random_prompts([5, 37, 12, 3]), [9, 4, 14, 6]
    engine = Engine(model, max_batch=2, max_len=64, prefill_chunk=16)
    got = run_requests(
        engine, [(p, n, i) for i, (p, n) in enumerate(zip(prompts, new, strict=True))]
    )
    keys = jax.vmap(jax.random.key)(np.arange(len(prompts)))
    want = eqllm.generate_batch(model, prompts, max_new_tokens=max(new), key=keys)
    assert [tokens for tokens, _ in got] == [w[:n].tolist() for w, n in zip(want, new, strict=True)]
    full = full_forward_logprobs(model, prompts, [tokens for tokens, _ in got], 64)
    for (_, logprobs), wanted in zip(got, full, strict=True):
        np.testing.assert_allclose(logprobs, wanted, atol=1e-4, rtol=0)
