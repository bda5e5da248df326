"""eqllm's machinery on a model of one's own: docs/examples/own_model.py, which docs/modules.md
shows, initialised, masked, given muP multipliers and LoRA adapters, without eqllm's config or
model classes (its sharding on 8 devices: tests/multidevice/test_own_model_mesh.py)."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqllm import lora
from eqllm.errors import EqllmError
from eqllm.parametrization import Multipliers, Scales, init_weights, multipliers
from eqllm.recipe import OptimSpec
from eqllm.sharding import MeshError, check_mesh, logical_axes, per_device_bytes, spec_for
from eqllm.train import decay_mask, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "own_model.py"


def load_example():
    """docs/examples/own_model.py as the module `own_model` (it is not part of a package)."""
    if "own_model" in sys.modules:
        return sys.modules["own_model"]
    spec = importlib.util.spec_from_file_location("own_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["own_model"] = module  # dataclasses resolve the annotations through it
    spec.loader.exec_module(module)
    return module


own = load_example()
TOKENS = jax.random.randint(jax.random.key(5), (2, 16), 0, 256)
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def built():
    return own.build(jax.random.key(0))  # muP at width 64 over base 32: m = 2, two layers


def windows(steps: int, rows: int = 8, length: int = 33) -> list[np.ndarray]:
    """Batches of byte windows of the example's own text (as its `main` makes them)."""
    text = np.frombuffer(EXAMPLE.read_bytes(), np.uint8).astype(np.int32)
    starts = np.random.default_rng(1).integers(0, len(text) - length, (steps, rows))
    return [text[row[:, None] + np.arange(length)] for row in starts]


def test_the_page_shows_the_whole_example_and_it_needs_no_eqllm_model():
    source = EXAMPLE.read_text()
    sections = re.findall(r"# --8<-- \[start:(\w+)\]", source)
    page = (ROOT / "docs" / "modules.md").read_text()
    assert re.findall(r'--8<-- "docs/examples/own_model.py:(\w+)"', page) == sections
    assert len(sections) == len(re.findall(r"# --8<-- \[end:\w+\]", source)) == 7
    for name in ("ModelConfig", "CausalLM", "eqllm.zoo", "eqllm.model", "eqllm.config"):
        assert name not in source


def test_initialisation_draws_each_weight_by_its_role(built):
    """Every weight leaves its layer's placeholder N(0, 0.02) for its role's std under muP:
    hidden matrices / sqrt(m), the residual role also / sqrt(2 n_layers); embedding and head
    keep 0.02, biases none here, norms one."""
    model, scales = built
    assert (scales.width, scales.residual_init_layers) == (2.0, 2)

    def std(get, tree=model):
        return float(np.std(np.stack([np.asarray(get(layer)) for layer in tree.layers])))

    expected = {
        "q_proj": (lambda b: b.attn.q_proj.weight, 0.02 / math.sqrt(2)),
        "o_proj": (lambda b: b.attn.o_proj.weight, 0.02 / math.sqrt(2 * 2) / math.sqrt(2)),
        "up": (lambda b: b.mlp.up.weight, 0.02 / math.sqrt(2)),
        "down": (lambda b: b.mlp.down.weight, 0.02 / math.sqrt(2 * 2) / math.sqrt(2)),
    }
    for name, (get, sigma) in expected.items():
        assert std(get) == pytest.approx(sigma, rel=0.05), name
    assert float(np.std(model.embed.weight)) == pytest.approx(0.02, rel=0.05)
    assert float(np.std(model.head.weight)) == pytest.approx(0.02, rel=0.05)
    assert all(np.all(np.asarray(b.attn_norm.weight) == 1.0) for b in model.layers)

    sp = init_weights(model, jax.random.key(3), n_layers=2)  # the standard parametrization
    assert std(lambda b: b.attn.q_proj.weight, sp) == pytest.approx(0.02, rel=0.05)
    assert std(lambda b: b.attn.o_proj.weight, sp) == pytest.approx(0.01, rel=0.05)
    assert float(np.std(sp.layers[0].mlp.gate.weight)) == pytest.approx(0.02, rel=0.05)
    with pytest.raises(EqllmError, match="init_weights takes scales"):
        init_weights(model, jax.random.key(3))


def test_decay_mask_and_mup_factors_drive_eqllms_adamw(built):
    """The mask and the multipliers read off the layers, and the first AdamW step that
    `make_optimizer(..., scales=)` takes equals Adam's closed form with them."""
    model, scales = built
    mask = decay_mask(model)
    assert mask.layers[0].attn.q_proj.weight and mask.layers[1].mlp.down.weight
    assert mask.head.weight and not mask.embed.weight and not mask.norm.weight
    factors = multipliers(model, scales)
    hidden = Multipliers(init=1 / math.sqrt(2), lr=0.5, eps=0.5, decay=2.0)
    assert factors.layers[0].attn.q_proj.weight == hidden
    assert factors.head.weight == factors.embed.weight == factors.norm.weight == Multipliers()

    lr, eps, wd, g = 1e-2, 1e-3, 0.1, 0.3
    spec = OptimSpec(lr=lr, warmup_steps=0, schedule="constant", clip_norm=0, eps=eps)
    optimizer = make_optimizer(spec, 10, model, scales=scales)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(lambda x: jnp.full_like(x, g), params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)

    def first_step(p, lr_f=1.0, eps_f=1.0, decay=0.0):  # Adam's bias-corrected m/v are g, g^2
        return -lr * lr_f * (g / (g + eps * eps_f) + decay * np.asarray(p))

    q = model.layers[0].attn.q_proj.weight
    np.testing.assert_allclose(
        updates.layers[0].attn.q_proj.weight, first_step(q, 0.5, 0.5, wd * 2.0), rtol=1e-6
    )
    np.testing.assert_allclose(
        updates.head.weight, first_step(model.head.weight, decay=wd), rtol=1e-6
    )
    np.testing.assert_allclose(updates.embed.weight, first_step(model.embed.weight), rtol=1e-6)


def test_logical_axes_give_the_shardings_without_devices(built):
    model, _ = built
    axes = logical_axes(model)
    assert axes["layers.0.attn.q_proj.weight"] == ("heads", "d_model")
    assert axes["layers.1.mlp.down.weight"] == ("d_model", "d_ff")
    assert axes["embed.weight"] == ("vocab", "d_model")
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    assert spec_for(axes["layers.0.attn.q_proj.weight"], (64, 64), mesh) == P("tensor", "fsdp")
    assert spec_for(axes["norm.weight"], (64,), mesh) == P()
    whole = sum(x.size * 4 for x in jax.tree.leaves(model))
    norms = 4 * 64 * (2 * 2 + 1)  # replicated
    assert per_device_bytes(model, {"fsdp": 4}) == (whole - norms) // 4 + norms
    with pytest.raises(MeshError, match=r"tensor=3 does not divide layers\.0\.attn\.n_heads=4"):
        check_mesh(model, {"tensor": 3})


def test_lora_names_its_targets_by_attribute_and_merges_back(built):
    model, _ = built
    assert lora.available_targets(model) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down", "head"
    ]  # fmt: skip
    assert lora.target_paths(model, ["q_proj", "head"]) == [
        "layers.0.attn.q_proj",
        "layers.1.attn.q_proj",
        "head",
    ]
    with pytest.raises(lora.LoraError, match=r"\['c_attn'\] are not linear modules of this model"):
        lora.apply(model, rank=2, alpha=4, targets=["c_attn"], key=jax.random.key(0))

    targets = ["q_proj", "v_proj"]
    adapted = lora.apply(model, rank=4, alpha=8, targets=targets, key=jax.random.key(3))
    # B = 0: the adapted model is its base (merged, every weight is the base's exactly)
    assert eqx.tree_equal(lora.merge(adapted), model)
    trainable = lora.trainable(adapted)
    assert trainable.layers[0].attn.q_proj.lora_b.weight and decay_mask(adapted) is not None
    assert not trainable.layers[0].attn.q_proj.base.weight and not trainable.embed.weight

    b_new = 0.05 * jax.random.normal(jax.random.key(2), (2, 64, 4))
    adapted = eqx.tree_at(lambda m: m.layers[0].attn.q_proj.lora_b.weight, adapted, b_new[0])
    adapted = eqx.tree_at(lambda m: m.layers[1].attn.q_proj.lora_b.weight, adapted, b_new[1])
    merged = lora.merge(adapted)
    assert not lora.adapters(merged)
    for i in range(2):
        a = np.asarray(adapted.layers[i].attn.q_proj.lora_a.weight, np.float64)
        w = np.asarray(model.layers[i].attn.q_proj.weight, np.float64)
        expected = w + 2.0 * np.asarray(b_new[i], np.float64) @ a  # alpha / rank = 2
        np.testing.assert_allclose(merged.layers[i].attn.q_proj.weight, expected, atol=1e-6)
    np.testing.assert_allclose(forward(merged, TOKENS), forward(adapted, TOKENS), atol=1e-5)


def test_own_model_trains_with_eqllms_step():
    """The example's `train` (eqllm's optimizer and TrainStep with the example's objective)
    equals the same optimizer stepped by hand; `fine_tune` trains only the adapters; `main`
    runs through on one device."""
    batches = windows(4)
    trained, losses = own.train(*own.build(jax.random.key(0)), batches)  # donates its model

    model, scales = own.build(jax.random.key(0))
    optimizer = make_optimizer(own.SPEC, len(batches), model, scales=scales)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    reference, ref_losses = model, []
    for tokens in batches:
        loss, grads = eqx.filter_value_and_grad(
            lambda m, t=tokens: own.NextToken().loss(m, {"tokens": jnp.asarray(t)})[0]
        )(reference)
        updates, state = optimizer.update(grads, state, eqx.filter(reference, eqx.is_inexact_array))
        reference = eqx.apply_updates(reference, updates)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    # Adam divides by the root of the second moment, so the last bits of a gradient that the
    # compiled step sums in another order move an update by up to ~1e-5 over these steps (each
    # update is ~1e-3); a wrong learning rate, decay or mask moves it by the update's size.
    np.testing.assert_allclose(
        trained.layers[1].mlp.down.weight, reference.layers[1].mlp.down.weight, atol=2e-5
    )

    before = jax.tree.map(np.array, trained)  # the step donates the arrays it is given
    merged, ft_losses = own.fine_tune(trained, scales, [batches[0]] * 4)  # fits one batch
    assert ft_losses[-1] < ft_losses[0] and not lora.adapters(merged)
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), merged, before)
    assert changed.layers[0].attn.q_proj.weight and changed.layers[1].attn.v_proj.weight
    assert not changed.layers[0].attn.k_proj.weight and not changed.layers[0].mlp.up.weight
    assert not changed.embed.weight and not changed.head.weight

    own.main("data=1", steps=3)


def test_scales_from_plain_sizes_refuse_what_they_cannot_scale():
    assert Scales.of(n_layers=3) == Scales("sp", 1.0, 1.0, 1.0, 1.0, 1.0, 3)
    s = Scales.of("completep", n_layers=8, d_model=256, base_d_model=64, base_n_layers=2)
    assert (s.width, s.depth, s.readout, s.branch, s.attention) == (4.0, 4.0, 0.25, 0.25, 0.5)
    assert s.residual_init_layers == 2
    with pytest.raises(EqllmError, match="parametrization='mup' needs d_model"):
        Scales.of("mup", n_layers=2)
    with pytest.raises(EqllmError, match="n_layers=0 must be a positive integer"):
        Scales.of(n_layers=0)
