"""Packing instruction examples into full rows, and document masking of pretraining windows,
checked against each example or document run on its own."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqllm import CausalLM
from eqllm.data import DataError, document_positions, document_segments, pack_examples
from eqllm.data.instruct import pad_rows
from eqllm.data.packing import assign_rows
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train.objectives import LanguageModel
from tests.conftest import TINY_CONFIGS

SEQ_LEN = 31  # rows of 32 tokens


def examples(n=12, seed=0):
    """(ids, loss mask) pairs of 4..30 tokens: a prompt (not trained) then a response."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 31))
        prompt = int(rng.integers(1, length - 1))
        ids = rng.integers(1, 97, length)
        out.append((ids, np.arange(length) >= prompt))
    return out


def test_first_fit_and_best_fit_place_every_example_once_within_capacity():
    lengths = [6, 5, 4, 3, 2, 5]
    # first-fit: 6 -> r0 (4 left), 5 -> r1 (5), 4 -> r0 (0), 3 -> r1 (2), 2 -> r1 (0), 5 -> r2
    assert assign_rows(lengths, 10, "first-fit") == [[0, 2], [1, 3, 4], [5]]
    assert assign_rows([7, 5, 3, 3], 10, "best-fit") == [[0, 2], [1, 3]]
    assert assign_rows([7, 5, 3, 3], 10, "first-fit") == [[0, 2], [1, 3]]
    # best-fit chooses the tightest room, first-fit the first: rooms 4 and 2 left, item of 2.
    assert assign_rows([6, 8, 2], 10, "best-fit") == [[0], [1, 2]]
    assert assign_rows([6, 8, 2], 10, "first-fit") == [[0, 2], [1]]
    for method in ("first-fit", "best-fit"):
        lens = [len(ids) for ids, _ in examples(40, seed=3)]
        plan = assign_rows(lens, SEQ_LEN + 1, method)
        assert sorted(i for row in plan for i in row) == list(range(40))
        assert all(sum(lens[i] for i in row) <= SEQ_LEN + 1 for row in plan)


def test_bad_packing_input_fails_clearly():
    with pytest.raises(DataError, match="not one of"):
        assign_rows([3], 10, "next-fit")
    with pytest.raises(DataError, match="example 1 has 0 tokens"):
        assign_rows([3, 0], 10, "best-fit")


def test_packing_keeps_each_examples_tokens_and_trained_targets():
    encoded = examples()
    packed = pack_examples(encoded, SEQ_LEN, pad_id=0, method="first-fit")
    padded_rows, padded_mask, _ = pad_rows(encoded, SEQ_LEN, pad_id=0)
    assert packed.rows.shape[0] < len(encoded)  # fewer rows than one per example
    assert packed.mask.sum() == padded_mask.sum()  # the same number of trained targets
    assert packed.padding_fraction < 1 - sum(len(i) for i, _ in encoded) / padded_rows.size + 1e-9
    # Each segment's tokens are one example's, whole (examples use ids >= 1, padding is 0).
    found = []
    for row, seg in zip(packed.rows, packed.segment_ids, strict=True):
        for s in np.unique(seg):
            tokens = tuple(int(t) for t in row[seg == s])
            if any(tokens):
                found.append(tokens)
            else:
                assert s == seg.max()  # the padding tail is the last segment
    assert sorted(found) == sorted(tuple(int(t) for t in ids) for ids, _ in encoded)


def masked_loss(logits, targets, mask):
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / mask.sum()


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "llama4",  # chunks counted from each document's start
        *(
            pytest.param(f, marks=pytest.mark.slow)
            for f in ("gpt2", "mixtral", "gemma4", "gemma4-moe")
        ),
    ],
)
@pytest.mark.parametrize("method", ["first-fit", pytest.param("best-fit", marks=pytest.mark.slow)])
def test_packed_loss_equals_padded_loss(family, method):
    """Same examples, packed with segment ids and restarting positions or padded one per row:
    the same mean loss over the response targets, through the train step."""
    model = CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    encoded = examples()
    rows, mask, _ = pad_rows(encoded, SEQ_LEN, pad_id=0)
    packed = pack_examples(encoded, SEQ_LEN, pad_id=0, method=method)
    padded = masked_loss(eqx.filter_jit(model)(jnp.asarray(rows[:, :-1])), rows[:, 1:], mask)
    inputs = packed.segment_ids[:, :-1]
    logits = eqx.filter_jit(model)(
        jnp.asarray(packed.rows[:, :-1]), document_positions(inputs), jnp.asarray(inputs)
    )
    np.testing.assert_allclose(
        masked_loss(logits, packed.rows[:, 1:], packed.mask), padded, rtol=0, atol=1e-5
    )
    # The train step reports the same loss for the packed batch (positions reset there).
    spec = OptimSpec(lr=1e-3, warmup_steps=0)
    optimizer = make_optimizer(spec, 2, eqx.filter(model, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 2), objective=LanguageModel(reset_positions=True))
    fresh = CausalLM(TINY_CONFIGS[family], key=jax.random.key(0))
    batch = {"tokens": packed.rows, "mask": packed.mask, "segment_ids": packed.segment_ids}
    _, _, metrics = step(fresh, init_opt_state(optimizer, fresh), batch)
    np.testing.assert_allclose(metrics["loss"], padded, rtol=0, atol=1e-5)


def documents_of(row, eot):
    """[start, end) of each document among a window's inputs: the end-of-text token opens one."""
    starts = [0] + [t for t in range(1, len(row)) if row[t] == eot]
    return list(zip(starts, [*starts[1:], len(row)], strict=True))


@pytest.mark.parametrize(
    "reset",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["positions-continue", "positions-reset"],
)
def test_document_mask_step_trains_on_each_document_alone(reset):
    """data.document_mask: the same windows, each document's targets scored from that document
    alone (the reference runs every document on its own)."""
    eot = 0
    rng = np.random.default_rng(1)
    batch = rng.integers(1, 97, (2, 25))
    batch[0, [5, 6, 14]] = eot
    batch[1, [10, 20]] = eot
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    # Each document alone: first in a row of its own (what follows it, causal attention never
    # lets it see), at its own positions; one compiled call for all of them.
    docs = [(r, s, e) for r, row in enumerate(batch) for s, e in documents_of(row[:-1], eot)]
    rows = np.stack([np.roll(batch[r, :-1], -s) for r, s, _ in docs])
    positions = np.stack([np.arange(24) + (0 if reset else s) for _, s, _ in docs])
    logits = eqx.filter_jit(lambda m, t, p: m(t, p))(model, jnp.asarray(rows), positions)
    total, count = 0.0, 0
    for i, (r, start, end) in enumerate(docs):
        targets = batch[r, start + 1 : end + 1]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[i, : end - start], targets)
        total, count = total + float(nll.sum()), count + (end - start)
    want = total / count
    spec = OptimSpec(lr=1e-3, warmup_steps=0)
    optimizer = make_optimizer(spec, 2, eqx.filter(model, eqx.is_inexact_array))
    lm = LanguageModel(document_token=eot, reset_positions=reset)
    step = TrainStep(optimizer, schedule(spec, 2), objective=lm)
    _, _, metrics = step(model, init_opt_state(optimizer, model), batch)
    np.testing.assert_allclose(metrics["loss"], want, rtol=0, atol=1e-5)
    # Without the mask the loss differs (the test can fail).
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    plain = TrainStep(optimizer, schedule(spec, 2))
    _, _, metrics = plain(model, init_opt_state(optimizer, model), batch)
    assert abs(float(metrics["loss"]) - want) > 1e-4
    np.testing.assert_array_equal(document_segments(batch, eot)[0, :8], [0] * 5 + [1, 2, 2])


def test_packed_instruction_data_has_less_padding_and_the_same_targets():
    """The shipped instruction examples, padded and packed: the same trained targets, fewer rows,
    a lower padding fraction (reported in the run's summary), padded validation rows."""
    from eqllm.data import Tokenizer
    from eqllm.data.instruct import prepare_instructions
    from eqllm.recipe import finetune_data_path

    path = finetune_data_path("data/python-instruct.jsonl")
    tok = Tokenizer.from_spec("bytes")
    padded = prepare_instructions(path, tok, seq_len=256, val_fraction=0.1)
    packed = prepare_instructions(path, tok, seq_len=256, val_fraction=0.1, pack="best-fit")
    assert packed.mask.sum() == padded.mask.sum()
    assert len(packed.rows) < len(padded.rows)
    assert packed.padding_fraction < padded.padding_fraction
    assert packed.meta["padding_fraction"] == round(packed.padding_fraction, 4)
    assert padded.segment_ids is None and packed.segment_ids.shape == packed.rows.shape
    np.testing.assert_array_equal(packed.val_rows, padded.val_rows)
    batch = packed.batch_at(3, seed=0, batch_size=4)
    tokens, mask, segments = batch["tokens"], batch["mask"], batch["segment_ids"]
    assert tokens.shape == segments.shape and mask.shape == (4, 256)
