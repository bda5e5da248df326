"""Document masking: each document inside a packed row computes exactly what it computes alone.

For every family (dense and mixture of experts), through the scanned, unrolled and pipelined
stacks, eqllm's own attention and the fused path's arguments (`implementation="xla"`): the logits
of each document in a packed row equal those of the document run alone within 1e-5. Windows
shorter than the documents and Gemma's local/global layers are in the tiny configs.
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.data.segments import document_positions, document_segments
from eqllm.train import Pipeline
from tests.families import TINY_CONFIGS, params

LENGTHS = (9, 4, 11)  # three documents in one row of 24 (longer than every test window)
SEQ = sum(LENGTHS)


def packed_row(seed: int):
    """(tokens, segment ids, positions restarting per document) of one packed row."""
    tokens = jax.random.randint(jax.random.key(seed), (SEQ,), 0, 97)
    segments = jnp.repeat(jnp.arange(len(LENGTHS)), jnp.array(LENGTHS), total_repeat_length=SEQ)
    return tokens, segments, document_positions(segments)


def documents(tokens):
    starts = np.cumsum((0, *LENGTHS[:-1]))
    return [(int(s), tokens[s : s + n]) for s, n in zip(starts, LENGTHS, strict=True)]


forward = eqx.filter_jit(lambda m, t, p, s: m(t, p, s))


def assert_each_document_alone(model, packed_logits, tokens, *, offset_positions=False):
    """Each document's logits in the packed row(s) against the document run alone.

    Alone means: the document in a row of its own, filled on the right with other tokens,
    which causal attention never lets it see; one compiled call runs all three documents.
    """
    docs = documents(tokens)
    rows = jnp.stack([jnp.roll(tokens, -start) for start, _ in docs])  # each doc first
    positions = None
    if offset_positions:
        positions = jnp.stack([start + jnp.arange(SEQ) for start, _ in docs])
    alone = forward(model, rows, positions, None)
    for i, (start, doc) in enumerate(docs):
        got = packed_logits[..., start : start + len(doc), :]
        want = np.broadcast_to(alone[i, : len(doc)], got.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "scan", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["scanned", "unrolled"]
)
@pytest.mark.parametrize("family", params({"gemma"}, where=lambda t: not t.variant))
def test_packed_documents_have_their_logits_alone(family, scan):
    model = eqllm.CausalLM(TINY_CONFIGS[family].replace(scan_layers=scan), key=jax.random.key(0))
    tokens, segments, positions = packed_row(1)
    # Three rows holding the same documents (the shape of the call running them alone).
    logits = forward(model, *(jnp.stack([a] * 3) for a in (tokens, positions, segments)))
    assert_each_document_alone(model, logits, tokens)


@pytest.mark.parametrize("family", ["gemma3", "mistral", "mixtral", "llama"])
def test_segments_with_default_positions_skip_blocks_and_still_mask(family):
    """Positions 0..seq-1 (no reset): the in-order path; each document as alone at its offset."""
    model = eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    tokens, segments, _ = packed_row(2)
    logits = forward(model, jnp.stack([tokens] * 3), None, jnp.stack([segments] * 3))
    assert_each_document_alone(model, logits, tokens, offset_positions=True)


def with_kernel(model, kernel):
    attn = copy.copy(model.blocks.attn)
    object.__setattr__(attn, "kernel", kernel)
    return eqx.tree_at(lambda m: m.blocks.attn, model, attn)


@pytest.mark.parametrize("reset", [True, False], ids=["reset-positions", "in-order"])
@pytest.mark.parametrize("family", ["gpt2", "mistral", "gemma3", "qwen3"])
def test_fused_path_masks_segments(family, reset):
    """The arguments given to jax.nn.dot_product_attention (run by XLA here, by cuDNN on a GPU)
    keep each document to itself, with and without restarting positions."""
    model = eqllm.CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    fused = with_kernel(model, "xla")
    tokens, segments, positions = packed_row(3)
    positions = jnp.stack([positions] * 3) if reset else None
    logits = forward(fused, jnp.stack([tokens] * 3), positions, jnp.stack([segments] * 3))
    assert_each_document_alone(model, logits, tokens, offset_positions=not reset)


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral", "gpt2"])
def test_pipelined_stack_masks_segments(family):
    """GPipe stages: segment ids and positions travel with their microbatch's activations."""
    config = TINY_CONFIGS[family]
    model = eqllm.CausalLM(config, key=jax.random.key(0))
    stages = 2 if config.n_layers % 2 == 0 else config.n_layers
    rows = [packed_row(seed) for seed in (4, 5, 6, 7, 8, 9)]  # two microbatches of three
    tokens, segments, positions = (jnp.stack(r) for r in zip(*rows, strict=True))
    hidden = eqx.filter_jit(Pipeline(stages, 2).hidden)(model, tokens, positions, segments)
    logits = eqx.filter_jit(model.logits)(hidden)
    for r, (row_tokens, _, _) in enumerate(rows):
        assert_each_document_alone(model, logits[r], row_tokens)


def test_document_segments_open_at_the_end_of_text_token():
    tokens = jnp.array([[5, 6, 0, 7, 8, 9, 0, 0, 4]])
    segments = document_segments(tokens, eot=0)
    np.testing.assert_array_equal(segments, [[0, 0, 1, 1, 1, 1, 2, 3, 3]])
    np.testing.assert_array_equal(document_positions(segments), [[0, 1, 0, 1, 2, 3, 0, 0, 1]])


def test_without_segments_documents_do_see_each_other():
    """The test above can fail: without segment ids a later document's logits change."""
    model = eqllm.CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    tokens, _, positions = packed_row(1)
    logits = forward(model, jnp.stack([tokens] * 3), jnp.stack([positions] * 3), None)
    with pytest.raises(AssertionError):
        assert_each_document_alone(model, logits, tokens)
