"""The optimizers a recipe names: Muon against torch.optim.Muon, Lion and Adafactor against
optax's own, Muon's parameter groups from the layers' metadata, and the recipe's checks."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from eqllm import zoo
from eqllm.nn import Embedding, ExpertLinear, Linear
from eqllm.recipe import OptimSpec, Recipe, RecipeError
from eqllm.train.optim import make_optimizer, muon_labels

# One learning rate throughout the step: no warmup, no decay, no clipping.
FLAT = dict(schedule="constant", warmup_steps=0, clip_norm=0.0)


def _step(spec: OptimSpec, model, grads_list):
    """`model`'s trainable arrays after one update per gradient in `grads_list`."""
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = make_optimizer(spec, 100, model)
    state = opt.init(params)
    for grads in grads_list:
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_muon_step_equals_torch_muon(scale):
    # A scanned stack of two (fan_out 12, fan_in 8) matrices: the leading layer axis is a batch
    # axis, so each layer's update must equal torch's on that matrix alone.
    keys = jax.random.split(jax.random.key(0), 2)
    layer = eqx.filter_vmap(lambda k: Linear(8, 12, axes=("d_ff", "d_model"), key=k))(keys)
    grad = jax.random.normal(jax.random.key(1), layer.weight.shape)
    lr, decay = 0.02, 0.1
    spec = OptimSpec(name="muon", lr=lr, weight_decay=decay, muon_scale=scale, **FLAT)
    assert muon_labels(layer).weight == "muon"
    got = _step(spec, layer, [eqx.tree_at(lambda m: m.weight, layer, grad)]).weight

    # optax's scale_by_shape with dimension numbers (in = -1, out = -2) multiplies by
    # sqrt(max(1, fan_out / fan_in)), torch's adjust_lr_fn="original"; with consistent_rms=0.2
    # by 0.2 * sqrt(max(fan_in, fan_out)), torch's "match_rms_adamw". Weight decay is lr * wd
    # in both. torch runs Newton-Schulz in bfloat16; made a no-op here, `.bfloat16()` leaves it
    # in float32, so both sides compare at fp32. optax's first Nesterov step differs from
    # torch's by a positive factor (bias correction), which the normalisation removes.
    for i in range(2):
        p = torch.nn.Parameter(torch.tensor(np.asarray(layer.weight[i])))
        p.grad = torch.tensor(np.asarray(grad[i]))
        opt = torch.optim.Muon(
            [p], lr=lr, weight_decay=decay, momentum=0.95, eps=1e-8, adjust_lr_fn=scale
        )
        bfloat16 = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda self: self.clone()
        try:
            opt.step()
        finally:
            torch.Tensor.bfloat16 = bfloat16
        np.testing.assert_allclose(np.asarray(got[i]), p.detach().numpy(), rtol=0, atol=2e-6)


def _small_tree():
    k1, k2 = jax.random.split(jax.random.key(2))
    return {
        "linear": Linear(8, 16, axes=("d_ff", "d_model"), use_bias=True, key=k1),
        "embed": Embedding(10, 8, axes=("vocab", "d_model"), key=k2),
    }


def _grads(params, n):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), n * len(leaves))
    it = iter(keys)
    return [
        jax.tree.unflatten(treedef, [jax.random.normal(next(it), x.shape) for x in leaves])
        for _ in range(n)
    ]


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_lion_and_adafactor_equal_optax(name):
    tree = _small_tree()
    params = eqx.filter(tree, eqx.is_inexact_array)
    grads = _grads(params, 3)
    lr, decay = 1e-3, 0.1
    # Only the Linear's matrix is decayed.
    mask = jax.tree.map(lambda _: False, params)
    mask = eqx.tree_at(lambda t: t["linear"].weight, mask, True)
    if name == "lion":
        spec = OptimSpec(name="lion", lr=lr, weight_decay=decay, b2=0.99, **FLAT)
        ref = optax.lion(lr, b1=0.9, b2=0.99, weight_decay=decay, mask=mask)
    else:
        # min_dim 8: the (16, 8) matrix's second moment is factored, the others are not.
        spec = OptimSpec(name="adafactor", lr=lr, weight_decay=decay, adafactor_min_dim=8, **FLAT)
        ref = optax.adafactor(
            lr, min_dim_size_to_factor=8, weight_decay_rate=lr * decay, weight_decay_mask=mask
        )
    got = _step(spec, tree, grads)
    state, want = ref.init(params), params
    for g in grads:
        updates, state = ref.update(g, state, want)
        want = optax.apply_updates(want, updates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _expected_group(path: str, layer) -> str | None:
    """The group a layer's weight belongs in, by what the layer is: a Linear of the stacked
    blocks whose axes are all width axes (not a router, a gate or a latent projection)
    -> Muon; embeddings, the LM head, stacked experts -> AdamW."""
    if isinstance(layer, Linear):
        in_stack = path.startswith((".blocks", ".dense_blocks"))
        return "muon" if in_stack and None not in layer.axes else "adamw"
    if isinstance(layer, Embedding | ExpertLinear):
        return "adamw"
    return None


@pytest.mark.parametrize("variant", ["llama-nano", "mixtral-nano", "deepseek_v3-nano"])
def test_muon_groups_come_from_the_layers(variant):
    model = zoo.create(variant, key=jax.random.key(0))
    labels = muon_labels(model)
    is_layer = lambda x: isinstance(x, Linear | Embedding | ExpertLinear)  # noqa: E731
    layers, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)
    groups, _ = jax.tree_util.tree_flatten_with_path(labels)
    group_at = {jax.tree_util.keystr(p): g for p, g in groups}
    seen = {"muon": 0, "adamw": 0}
    for path, layer in layers:
        where = jax.tree_util.keystr(path)
        if not is_layer(layer):  # norm scales, a router's score bias: AdamW
            if eqx.is_inexact_array(layer):
                assert group_at[where] == "adamw", where
            continue
        want = _expected_group(where, layer)
        assert group_at[f"{where}.weight"] == want, where
        seen[want] += 1
        if want == "muon":  # stacked blocks: a leading layer axis, orthogonalised per layer
            assert layer.weight.ndim == 3, where
        if getattr(layer, "bias", None) is not None:
            assert group_at[f"{where}.bias"] == "adamw", where
    assert group_at[".embed.weight"] == "adamw" and seen["muon"] >= 4
    if variant != "llama-nano":
        experts = [g for p, g in group_at.items() if p.startswith(".blocks.mlp.gate.")]
        assert experts and set(experts) == {"adamw"}


def _recipe(**optim) -> dict:
    return {"model": {"variant": "llama-nano"}, "train": {"steps": 1}, "optim": optim}


@pytest.mark.parametrize(
    "optim, message",
    [
        (
            {"name": "sgd"},
            "optim.name='sgd' must be one of 'adamw', 'muon', 'soap', 'lion', 'adafactor'",
        ),
        (
            {"muon_momentum": 0.9},
            'optim.muon_momentum=0.9 is not used by optim.name="adamw" (only by "muon"); '
            'remove optim.muon_momentum or set optim.name to "muon"',
        ),
        ({"name": "lion", "eps": 1e-6}, 'optim.eps=1e-06 is not used by optim.name="lion"'),
        ({"name": "muon", "adafactor_min_dim": 4}, 'set optim.name to "adafactor"'),
        ({"name": "adafactor", "b1": 0.8}, 'optim.b1=0.8 is not used by optim.name="adafactor"'),
    ],
)
def test_recipe_refuses_unknown_optimizers_and_misplaced_fields(optim, message):
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(_recipe(**optim), inputs=False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_muon_refuses_lora():
    values = _recipe(name="muon")
    values["model"]["init_from"] = "some/model"
    values["finetune"] = {"method": "lora"}
    with pytest.raises(RecipeError, match='set optim.name="adamw"'):
        Recipe.from_dict(values, inputs=False)


def test_each_optimizer_keeps_its_defaults_valid():
    for name in ("adamw", "muon", "soap", "lion", "adafactor"):
        assert Recipe.from_dict(_recipe(name=name), inputs=False).optim.name == name
    # A run folder written before optim.name existed reads as AdamW.
    assert Recipe.from_dict(_recipe(lr=1e-3), inputs=False).optim == OptimSpec(lr=1e-3)


def test_muon_update_of_a_scanned_model_is_finite():
    """One Muon step on a tiny MoE model: the stacked matrices go through Newton-Schulz one
    layer at a time, the experts through AdamW."""
    model = zoo.create("mixtral-nano", key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = make_optimizer(OptimSpec(name="muon", **FLAT), 10, model)
    updates, _ = jax.jit(opt.update)(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
    assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
