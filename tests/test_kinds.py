"""One per-layer mechanism for every layer pattern (`eqllm.config.kinds`, `eqllm.stack.run`).

`ModelConfig.layer_kinds` says which stack holds each layer ("dense", "full", "linear"); the
stack runs the kinds in segments (a run of one kind, or a pattern repeated, plus a remainder).
Here: the segments of the patterns people ship, and models whose pattern is irregular (a hybrid
whose attention layer sits mid-group, a depth that is no whole number of periods, windows and
NoPE inside the groups; Llama 4 Maverick's dense and expert layers) equal the same layers
applied one by one, by hand, in layer order. The family contract (tests/test_families.py)
checks DeepSeek's prefix, the hybrids and Maverick against transformers.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm.config.kinds import Segment, segments, stack_layers
from eqllm.train.step import _layer_grad_norms as layer_grad_norms
from tests.families import TINY_CONFIGS

L, F, D = "linear", "full", "dense"

# Linear, full, linear repeated over 7 layers: L F L | L F L | L. The attention layers (1, 4)
# are one windowed and one global, layer 4 without RoPE: the flags differ within a kind.
IRREGULAR = TINY_CONFIGS["qwen3_5"].replace(
    n_layers=7,
    linear={"full_every": None, "pattern": ("linear", "full", "linear")},
    attention={"sliding_window": 6, "global_every": 2},
    positions={"nope_every": 5},
)
MAVERICK = TINY_CONFIGS["llama4-maverick"]  # D F D F D F D, chunked x2 then global
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 97, size=(2, 40)))


@pytest.mark.parametrize(
    "kinds, expected",
    [
        ((F,) * 4, [(0, (F,), 4)]),
        ((D,) * 3 + (F,) * 5, [(0, (D,), 3), (3, (F,), 5)]),  # DeepSeek's dense prefix
        ((D, F) * 3 + (D,), [(0, (D, F), 3), (6, (D,), 1)]),  # Maverick, a remainder
        ((L, L, L, F) * 2 + (L, L), [(0, (L, L, L, F), 2), (8, (L,), 2)]),
        ((L, F, L) * 2 + (L,), [(0, (L, F, L), 2), (6, (L,), 1)]),
        # No repeat: runs of one kind.
        ((L, L, F, L, L, L), [(0, (L,), 2), (2, (F,), 1), (3, (L,), 3)]),
    ],
)
def test_segments_cut_the_kinds_into_repeated_patterns(kinds, expected):
    got = segments(kinds)
    assert got == tuple(Segment(*e) for e in expected)
    assert [k for s in got for _ in range(s.repeats) for k in s.pattern] == list(kinds)


def test_layer_kinds_say_which_stack_holds_each_layer():
    assert MAVERICK.layer_kinds() == (D, F, D, F, D, F, D)
    assert IRREGULAR.layer_kinds() == (L, F, L, L, F, L, L)
    deepseek = TINY_CONFIGS["deepseek_v2"]
    prefix = deepseek.moe.dense_layers
    assert deepseek.layer_kinds() == (D,) * prefix + (F,) * (deepseek.n_layers - prefix)
    assert stack_layers(MAVERICK) == {"dense_blocks": (0, 2, 4, 6), "blocks": (1, 3, 5)}
    assert stack_layers(IRREGULAR) == {"linear_blocks": (0, 2, 3, 5, 6), "blocks": (1, 4)}


def _by_hand(model, tokens):
    """The logits and router logits of the layers applied one at a time, in layer order, each
    with its own flags as Python bools: the reference the stacked run must equal."""
    cfg = model.config
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    x = model.embed_inputs(tokens, positions)
    local, rotate = cfg.local_layers(), cfg.rotary_layers()
    flags = cfg.attention.global_every is not None, cfg.positions.nope_every is not None
    routers = []
    for i, block in enumerate(model.layers()):
        x, routing = block.routed(
            x,
            positions,
            local[i] if flags[0] else None,
            None,
            rotate[i] if flags[1] else None,
        )
        if routing is not None:
            routers.append(routing.logits)
    logits = model.logits(model.final_norm(x))
    return logits, (jnp.stack(routers) if routers else None)


@pytest.fixture(scope="module", params=["irregular", "maverick"])
def pair(request):
    cfg = {"irregular": IRREGULAR, "maverick": MAVERICK}[request.param]
    model = eqllm.CausalLM(cfg, key=jax.random.key(1))
    with jax.default_matmul_precision("highest"):
        return model, _by_hand(model, TOKENS)


@pytest.mark.parametrize(
    "setting",
    [
        {},
        pytest.param({"scan_layers": False}, marks=pytest.mark.slow),
        pytest.param({"remat": "full"}, marks=pytest.mark.slow),
    ],
)
def test_stacked_run_equals_the_layers_one_by_one(pair, setting):
    model, (want, want_routers) = pair
    model = model.with_config(**setting)
    with jax.default_matmul_precision("highest"):
        got, routing = model.routing(TOKENS)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    if want_routers is None:
        assert routing is None
    else:  # the routed layers' router logits, in layer order
        assert routing.logits.shape[0] == model.config.layer_kinds().count(F)
        np.testing.assert_allclose(routing.logits, want_routers, atol=2e-5, rtol=0)


@pytest.mark.slow  # the family contract decodes Maverick and the hybrids by default
def test_cached_decoding_equals_the_full_forward_on_an_irregular_pattern(pair):
    model, (want, _) = pair
    tokens = TOKENS[0]
    with jax.default_matmul_precision("highest"):
        logits, cache = model.prefill(tokens[:30], jnp.arange(30), model.init_cache(40))
        np.testing.assert_allclose(logits, want[0, 29], atol=2e-5, rtol=0)
        for t in range(30, 34):
            logits, cache = model.decode(tokens[t], jnp.asarray(t), cache)
            np.testing.assert_allclose(logits, want[0, t], atol=2e-5, rtol=0)


def test_layers_and_with_layers_are_inverse(pair):
    model, _ = pair
    again = model.with_layers(model.layers())
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_layer_grad_norms_are_in_layer_order(pair):
    """Each layer's norm is that of its own slice of its stack."""
    model, _ = pair
    grads = eqx.filter(model, eqx.is_inexact_array)
    got = np.asarray(layer_grad_norms(grads)["grad_norm/layer"])
    want = [
        np.sqrt(sum(np.sum(np.square(a)) for a in jax.tree.leaves(eqx.filter(layer, eqx.is_array))))
        for layer in model.layers()
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5)
