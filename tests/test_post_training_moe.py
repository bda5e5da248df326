"""Post-training objectives on a mixture of experts add its load-balancing loss, as
pretraining does: DPO-family and GRPO losses on a tiny MoE against a direct computation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS

from eqllm import CausalLM
from eqllm.nn import load_balancing_loss
from eqllm.train.objectives import Grpo, Preference, group_advantages, grpo_loss

COEF = 0.1


@pytest.fixture(scope="module")
def moe():
    cfg = TINY_CONFIGS["qwen2_moe"].replace(moe={"aux_loss_coef": COEF})
    return CausalLM(cfg, key=jax.random.key(0))


@eqx.filter_jit
def _direct(model, tokens, temperature=1.0):
    """Per-token log-probabilities and the load-balancing loss of one forward, written out."""
    logits, router = model.routed(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits / temperature)
    logp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return logp, load_balancing_loss(router, model.config.moe.experts_per_token)


def test_preference_loss_adds_the_load_balancing_loss(moe):
    rng = np.random.default_rng(0)
    vocab = moe.config.vocab_size
    tokens = jnp.asarray(rng.integers(0, vocab, (2, 2, 12)))
    mask = jnp.asarray(np.arange(11)[None, None] >= rng.integers(3, 8, (2, 2, 1)))
    ref = jnp.asarray(rng.normal(-30, 1, (2, 2)).astype(np.float32))
    batch = {"tokens": tokens, "mask": mask, "ref": ref}
    loss, parts = eqx.filter_jit(Preference("dpo", 0.1))(moe, batch)

    logp, aux = _direct(moe, tokens.reshape(4, -1))
    policy = jnp.sum(jnp.where(mask.reshape(4, -1), logp, 0.0), -1).reshape(2, 2)
    delta = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    dpo = -jnp.mean(jax.nn.log_sigmoid(0.1 * delta))
    assert float(aux) > 0
    assert float(parts["aux_loss"]) == pytest.approx(float(aux), rel=1e-5)
    assert float(loss) == pytest.approx(float(dpo + COEF * aux), rel=1e-5)
    assert parts["expert_load"].shape == (moe.config.n_layers, moe.config.moe.n_experts)


@pytest.mark.slow  # two gradients of a mixture of experts compiled: several seconds
def test_grpo_loss_adds_the_load_balancing_loss_and_its_gradient(moe):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, moe.config.vocab_size, (4, 10)))
    mask = jnp.asarray(np.arange(9)[None] >= rng.integers(2, 6, (4, 1)))
    rewards = np.array([1.0, 0.0, 0.5, 1.0], np.float32)
    adv = jnp.asarray(group_advantages(rewards, 2))
    batch = {"tokens": tokens, "mask": mask, "advantages": adv, "rewards": jnp.asarray(rewards)}
    objective = Grpo(max_new_tokens=8, temperature=0.8)
    (loss, parts), grads = eqx.filter_jit(eqx.filter_value_and_grad(objective, has_aux=True))(
        moe, batch
    )

    def direct(model):
        logp, aux = _direct(model, tokens, 0.8)
        settings = dict(epsilon=0.2, epsilon_high=0.2, kl_coef=0.0, max_new_tokens=8)
        old = jax.lax.stop_gradient(logp)
        surrogate, _ = grpo_loss(logp, old, None, adv, mask, normalization="sequence", **settings)
        return surrogate + COEF * aux

    expected, expected_grads = eqx.filter_jit(eqx.filter_value_and_grad(direct))(moe)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert float(parts["aux_loss"]) > 0
    router = lambda m: m.blocks.mlp.router.weight  # noqa: E731  the routers get a gradient
    np.testing.assert_allclose(router(grads), router(expected_grads), rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(router(grads)).max()) > 0


def test_dense_objectives_have_no_balance_term():
    from eqllm.train.objectives import routed_logps

    dense = CausalLM(TINY_CONFIGS["llama"], key=jax.random.key(0))
    tokens = jnp.zeros((2, 6), jnp.int32)
    assert eqx.filter_jit(routed_logps)(dense, tokens)[1] == {}
