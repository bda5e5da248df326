"""SOAP (`eqllm.train.soap`) against a float64 NumPy transcription of the authors' reference
(github.com/nikhilvyas/SOAP, soap.py; merge_dims, precondition_1d and normalize_grads off), and
the recipe's checks of its fields."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIGS

from eqllm import CausalLM, zoo
from eqllm.nn import Embedding, Linear
from eqllm.recipe import OptimSpec, Recipe, RecipeError
from eqllm.train import TrainStep, init_opt_state, schedule
from eqllm.train.optim import decay_mask, make_optimizer, soap_matrices


class ReferenceSoap:
    """The reference's `SOAP.step` for one tensor, in float64 loops: the first call accumulates
    GG and takes its eigenbases (no update); later calls run Adam on the projected gradient, step
    the weight, decay it, then update GG, refresh the bases by power iteration + QR every
    `freq` steps (sorting the columns and exp_avg_sq alike), and rotate exp_avg."""

    def __init__(self, shape, *, lr, b1, b2, shampoo_beta, eps, wd, freq, max_dim):
        self.lr, self.b1, self.b2, self.sb, self.eps = lr, b1, b2, shampoo_beta, eps
        self.wd, self.freq, self.step = wd, freq, 0
        self.exp_avg, self.exp_avg_sq = np.zeros(shape), np.zeros(shape)
        if len(shape) == 1:
            self.gg = [None]  # precondition_1d off: the 1-D path is Adam
        else:
            self.gg = [np.zeros((d, d)) if d <= max_dim else None for d in shape]
        self.q = None

    def project(self, x):
        for q in self.q:
            # tensordot over the leading axis moves the projected axis last
            x = np.moveaxis(x, 0, -1) if q is None else np.tensordot(x, q, axes=([0], [0]))
        return x

    def project_back(self, x):
        for q in self.q:
            x = np.moveaxis(x, 0, -1) if q is None else np.tensordot(x, q, axes=([0], [1]))
        return x

    def __call__(self, p, g):
        if self.q is None:
            self.update_preconditioner(g)
            return p
        gp = self.project(g)
        self.step += 1
        self.exp_avg = self.b1 * self.exp_avg + (1 - self.b1) * gp
        self.exp_avg_sq = self.b2 * self.exp_avg_sq + (1 - self.b2) * gp**2
        denom = np.sqrt(self.exp_avg_sq) + self.eps
        size = self.lr * np.sqrt(1 - self.b2**self.step) / (1 - self.b1**self.step)
        p = p - size * self.project_back(self.exp_avg / denom)
        p = p - self.lr * self.wd * p
        self.update_preconditioner(g)
        return p

    def update_preconditioner(self, g):
        if self.q is not None:
            self.exp_avg = self.project_back(self.exp_avg)
        for k, gg in enumerate(self.gg):
            if gg is not None:
                others = [i for i in range(g.ndim) if i != k]
                outer = np.tensordot(g, g, axes=(others, others))
                self.gg[k] = gg + (1 - self.sb) * (outer - gg)  # torch's lerp_
        if self.q is None:
            self.q = [None if m is None else np.linalg.eigh(m)[1][:, ::-1] for m in self.gg]
        if self.step > 0 and self.step % self.freq == 0:
            new = []
            for k, (m, o) in enumerate(zip(self.gg, self.q, strict=True)):
                if m is None:
                    new.append(None)
                    continue
                order = np.argsort(-np.diag(o.T @ m @ o))
                self.exp_avg_sq = np.take(self.exp_avg_sq, order, axis=k)
                new.append(np.linalg.qr(m @ o[:, order])[0])
            self.q = new
        if self.step > 0:
            self.exp_avg = self.project(self.exp_avg)


HYPER = dict(lr=0.01, b1=0.9, b2=0.95, shampoo_beta=0.9, eps=1e-8, freq=2, max_dim=6)
SPEC = OptimSpec(
    name="soap",
    lr=HYPER["lr"],
    b1=HYPER["b1"],
    b2=HYPER["b2"],
    weight_decay=0.1,
    soap_shampoo_beta=HYPER["shampoo_beta"],
    soap_precondition_frequency=HYPER["freq"],
    soap_max_precond_dim=HYPER["max_dim"],
    schedule="constant",
    warmup_steps=0,
    clip_norm=0.0,
)


def _tree():
    keys = jax.random.split(jax.random.key(0), 5)
    return {
        # both sides preconditioned (6 <= max_dim); the bias is Adam
        "square": Linear(6, 6, axes=("d_ff", "d_model"), use_bias=True, key=keys[0]),
        # (4, 9): the input side (9 > max_dim) keeps the identity
        "wide": Linear(9, 4, axes=("d_ff", "d_model"), key=keys[1]),
        # (9, 5): the output side keeps the identity
        "tall": Linear(5, 9, axes=("d_ff", "d_model"), key=keys[2]),
        # a scanned stack of two (5, 5) matrices: each with its own statistics and bases
        "stack": eqx.filter_vmap(lambda k: Linear(5, 5, axes=("d_ff", "d_model"), key=k))(
            jax.random.split(keys[3], 2)
        ),
        # an embedding is a matrix too (not decayed)
        "embed": Embedding(5, 4, axes=("vocab", "d_model"), key=keys[4]),
    }


def test_soap_equals_the_reference_over_five_steps():
    """Five steps with a refresh every two (eigh at the first call, QR at steps 2 and 4)."""
    tree = _tree()
    matrices = soap_matrices(tree)
    assert matrices["square"].weight and not matrices["square"].bias and matrices["embed"].weight
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(np.float64), eqx.filter(tree, eqx.is_array))
        leaves, treedef = jax.tree.flatten(params)
        rng = np.random.default_rng(0)
        grads = [[rng.standard_normal(x.shape) for x in leaves] for _ in range(5)]
        opt = make_optimizer(SPEC, 100, tree)
        state = opt.init(params)
        update = jax.jit(opt.update)
        got = params
        for g in grads:
            updates, state = update(jax.tree.unflatten(treedef, g), state, got)
            got = optax.apply_updates(got, updates)
        got = [np.asarray(x) for x in jax.tree.leaves(got)]
    assert all(x.dtype == np.float64 for x in got)

    decayed = jax.tree.leaves(jax.tree.map(lambda i: bool(i), decay_mask(tree)))
    is_matrix = jax.tree.leaves(matrices)
    for i, leaf in enumerate(leaves):
        # a stack's matrices (and a vector) each on their own
        parts = np.asarray(leaf).reshape(-1, *leaf.shape[-2:]) if is_matrix[i] else [leaf]
        want = []
        for j, p in enumerate(parts):
            p = np.array(p, np.float64)
            ref = ReferenceSoap(p.shape, wd=0.1 if decayed[i] else 0.0, **HYPER)
            for g in grads:
                gj = g[i].reshape(-1, *p.shape)[j] if is_matrix[i] else g[i]
                p = ref(p, gj)
            want.append(p)
        want = np.stack(want).reshape(leaf.shape)
        assert not np.allclose(want, leaf), i  # the steps moved it
        np.testing.assert_allclose(got[i], want, rtol=1e-9, atol=1e-12)


def test_soap_first_step_moves_nothing():
    tree = _tree()
    params = eqx.filter(tree, eqx.is_array)
    opt = make_optimizer(SPEC, 100, tree)
    grads = jax.tree.map(lambda x: x + 1.0, params)
    updates, state = opt.update(grads, opt.init(params), params)
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
    updates, _ = opt.update(grads, state, params)
    assert all(np.asarray(u).any() for u in jax.tree.leaves(updates))


@pytest.mark.slow  # the experts' stacked bases: a long compile on two cores
def test_soap_takes_every_layer_weight_of_a_moe_model():
    """Every Linear, expert and embedding weight is a matrix (the experts' and layers' leading
    axes are batch axes); norms and biases are not. One jitted step is finite."""
    model = zoo.create("mixtral-nano", key=jax.random.key(0))
    matrices = soap_matrices(model)
    assert matrices.embed.weight and matrices.blocks.mlp.gate.weight
    assert not matrices.final_norm.weight
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = make_optimizer(OptimSpec(name="soap", warmup_steps=0), 10, model)
    state = opt.init(params)
    grads = jax.tree.map(lambda x: np.full(x.shape, 0.01, x.dtype), params)
    step = jax.jit(opt.update)
    for _ in range(2):
        updates, state = step(grads, state, params)
    assert all(bool(np.isfinite(u).all()) for u in jax.tree.leaves(updates))


def _recipe(**optim) -> dict:
    return {"model": {"variant": "llama-nano"}, "train": {"steps": 1}, "optim": optim}


@pytest.mark.parametrize(
    "optim, message",
    [
        (
            {"soap_precondition_frequency": 5},
            'optim.soap_precondition_frequency=5 is not used by optim.name="adamw" (only by '
            '"soap"); remove optim.soap_precondition_frequency or set optim.name to "soap"',
        ),
        ({"name": "muon", "soap_shampoo_beta": 0.9}, 'set optim.name to "soap"'),
        ({"name": "soap", "soap_shampoo_beta": 1.0}, "optim.soap_shampoo_beta"),
        ({"name": "soap", "soap_max_precond_dim": 0}, "optim.soap_max_precond_dim"),
        ({"name": "soap", "soap_precondition_frequency": 0}, "optim.soap_precondition_frequency"),
        (
            {"name": "soap", "muon_ns_steps": 3},
            'optim.muon_ns_steps=3 is not used by optim.name="soap"',
        ),
    ],
)
def test_recipe_checks_soap_fields(optim, message):
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(_recipe(**optim), inputs=False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_soap_recipe_and_lora():
    spec = Recipe.from_dict(_recipe(name="soap", soap_max_precond_dim=512), inputs=False).optim
    assert spec.name == "soap" and spec.soap_max_precond_dim == 512
    # LoRA: the adapters' A (rank, in) and B (out, rank) are matrices SOAP preconditions.
    values = _recipe(name="soap")
    values["model"]["init_from"] = "some/model"
    values["finetune"] = {"method": "lora"}
    assert Recipe.from_dict(values, inputs=False).optim.name == "soap"


def _train(grad_accum: int, steps: int):
    model = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    spec = OptimSpec(name="soap", lr=1e-2, warmup_steps=0, soap_precondition_frequency=3)
    optimizer = make_optimizer(spec, 20, eqx.filter(model, eqx.is_inexact_array))
    step = TrainStep(optimizer, schedule(spec, 20), grad_accum=grad_accum)
    opt_state = init_opt_state(optimizer, model)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, 17)), jnp.int32)
    seen = []
    for _ in range(steps):
        model, opt_state, metrics = step(model, opt_state, batch)
        seen.append(float(metrics["loss"]))
    return seen, model, step


def test_soap_trains_the_tiny_llama_and_accumulates_gradients():
    """The loss falls over eight SOAP steps (two eigenbasis refreshes); two micro-batches give
    the losses of one big batch: equal until the first move, then within 2%. A (16, 32)
    gradient's G^T G has rank 16, so half of its eigenbasis spans a null space that rounding
    picks; the sum of micro-batches rounds differently and Adam's coordinates there differ (the
    reference has the same freedom)."""
    seen, model, step = _train(1, 8)
    assert seen[1] == seen[0]  # the first step only accumulates the preconditioners
    assert seen[-1] < seen[0] - 0.5, seen
    assert step.n_traces == 1
    accumulated, _, _ = _train(2, 8)
    np.testing.assert_allclose(accumulated[:2], seen[:2], rtol=1e-5)
    np.testing.assert_allclose(accumulated, seen, rtol=2e-2)
    assert accumulated[-1] < accumulated[0] - 0.5
