"""Training on a mesh equals training on one device; checkpoints move between meshes."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqllm
from eqllm.recipe import OptimSpec
from eqllm.runs import Checkpointer
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule
from eqllm.train.stability import ema_params
from tests.multidevice import CFG, MESHES

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

STEPS = 3
# AdamW with eps=1e-3: Adam's first updates are ~sign(gradient), so an element whose gradient is
# ~1e-9 moves by +-lr on a sign flip that mere summation order causes; a larger eps keeps the
# update a smooth function of the gradient, and the comparison below tight.
SPEC = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3)


def batches():
    return [jax.random.randint(jax.random.key(10 + i), (8, 33), 0, 96) for i in range(STEPS)]


def train(mesh=None, spec=SPEC, cfg=CFG):
    model = eqllm.CausalLM(cfg, key=jax.random.key(0))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(model, mesh)
        model = shard_model(model, mesh)
    optimizer = make_optimizer(spec, 10, eqx.filter(model, eqx.is_inexact_array))
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(optimizer, schedule(spec, 10), param_shardings=shardings)
    losses = []
    for batch in batches():
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh))
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return model, opt_state, losses, step


@pytest.fixture(scope="module")
def reference():
    model, _, losses, _ = train()
    return model, losses


@pytest.mark.parametrize("mesh_text", MESHES)
def test_mesh_training_equals_single_device(reference, mesh_text):
    ref_model, ref_losses = reference
    mesh = make_mesh(MeshConfig.parse(mesh_text))
    model, _, losses, step = train(mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    assert step.n_traces == 1
    # The updated parameters stay where the rules put them.
    expected = param_shardings(model, mesh)
    for leaf, sharding in zip(jax.tree.leaves(model), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_checkpoint_moves_between_meshes(tmp_path):
    mesh_a = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    model, opt_state, _, _ = train(mesh_a)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(STEPS, model, opt_state, {"note": "mesh a"}, wait=True)
    template = eqllm.CausalLM(CFG, key=jax.random.key(1))
    optimizer = make_optimizer(SPEC, 10, eqx.filter(template, eqx.is_inexact_array))
    for target in ("data=8", "data=1,tensor=8", None):
        t_model, shardings = template, None
        if target is not None:
            mesh = make_mesh(MeshConfig.parse(target))
            t_model, shardings = shard_model(template, mesh), param_shardings(template, mesh)
        restored, _, meta = ckpt.restore(t_model, init_opt_state(optimizer, t_model, shardings))
        assert meta["note"] == "mesh a"
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if target is not None:
            q = restored.blocks.attn.q_proj.weight
            assert q.sharding.is_equivalent_to(t_model.blocks.attn.q_proj.weight.sharding, 3)
    ckpt.close()


def test_batch_rows_must_split_over_data_devices():
    from eqllm.recipe import Recipe, RecipeError
    from eqllm.train.loop import place_on_mesh

    recipe = Recipe.from_dict(
        {
            "model": {
                "variant": "llama-nano",
                "overrides": {"attention": {"n_heads": 8, "n_kv_heads": 8}},
            },
            "train": {"batch_size": 12, "steps": 1},
            "mesh": {"data": 8},
        }
    )
    with pytest.raises(RecipeError, match="do not split over data\\*fsdp=8"):
        place_on_mesh(recipe, eqllm.CausalLM(recipe.model_config(), key=jax.random.key(0)))
    with pytest.raises(RecipeError, match="mesh.data=0"):
        Recipe.from_dict(
            {"model": {"variant": "llama-nano"}, "train": {"steps": 1}, "mesh": {"data": 0}}
        )


@pytest.mark.parametrize("name", ["muon", "lion", "adafactor"])
def test_each_optimizer_trains_on_a_mesh_as_on_one_device(name, monkeypatch):
    """Muon's and Lion's state is shaped like the parameters; Adafactor's factored row and
    column statistics are not, and stay replicated where a parameter is split."""
    extra = {"adafactor_min_dim": 8} if name == "adafactor" else {}  # factor every matrix
    monkeypatch.setattr(
        "tests.multidevice.test_train_mesh.SPEC",
        OptimSpec(name=name, lr=1e-2, warmup_steps=0, **extra),
    )
    model, _, ref_losses, _ = train()
    _, _, losses, step = train(make_mesh(MeshConfig.parse("data=2,fsdp=4")))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert step.n_traces == 1


def test_ema_and_spike_window_train_on_a_mesh_as_on_one_device():
    """optim.ema and optim.skip_spike_window on a mesh: the same losses and EMA as on one
    device, the EMA placed like the parameters, the window replicated."""
    spec = OptimSpec(lr=1e-2, warmup_steps=0, eps=1e-3, ema=0.5, skip_spike_window=4)
    _, ref_state, ref_losses, _ = train(None, spec)
    mesh = make_mesh(MeshConfig.parse("data=2,fsdp=2,tensor=2"))
    model, opt_state, losses, step = train(mesh, spec)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ema, ref_ema = ema_params(opt_state), ema_params(ref_state)
    expected = param_shardings(model, mesh)
    for a, b, sharding in zip(
        jax.tree.leaves(ema), jax.tree.leaves(ref_ema), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
        assert a.sharding.is_equivalent_to(sharding, a.ndim)
    assert int(opt_state.filled) == STEPS and step.n_traces == 1


@pytest.mark.parametrize(
    ("name", "parametrization"), [("muon", "sp"), ("muon", "mup"), ("adamw", "mup")]
)
def test_parameter_groups_on_fsdp_and_tensor_equal_one_device(name, parametrization):
    """Muon (its matrices beside an AdamW group) and muP (one AdamW per role) keep one state per
    group (`optax.multi_transform`), with empty `optax.MaskedNode`s at the other groups'
    parameters. On fsdp=4,tensor=2 they train as on one device (XLA splits each matrix's
    Newton-Schulz products over the devices that hold its pieces), and their moments stay split
    like their parameters (they were whole on every device)."""
    cfg = CFG if parametrization == "sp" else CFG.replace(parametrization="mup", base_d_model=32)
    eps = {"eps": 1e-3} if name == "adamw" else {}  # as SPEC: Adam's first steps are ~sign(g)
    spec = OptimSpec(name=name, lr=1e-2, warmup_steps=0, **eps)
    ref_model, _, ref_losses, _ = train(None, spec, cfg)
    mesh = make_mesh(MeshConfig.parse("fsdp=4,tensor=2"))
    model, opt_state, losses, step = train(mesh, spec, cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref_model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert step.n_traces == 1
    # whether each shape of parameter is whole on every device (the stacked norm scales are)
    whole = {x.shape: x.sharding.is_fully_replicated for x in jax.tree.leaves(model) if x.ndim > 1}
    # a momentum per matrix (Muon), or two moments per matrix (AdamW), in the groups' states
    moments = [x for x in jax.tree.leaves(opt_state) if x.shape in whole]
    assert len(moments) >= len([x for x in jax.tree.leaves(model) if x.ndim > 1])
    assert [x.sharding.is_fully_replicated for x in moments] == [whole[x.shape] for x in moments]
    assert not all(whole.values())
