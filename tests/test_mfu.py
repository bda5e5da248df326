"""The FLOPs a training step performs, for MFU and HFU, against hand counts."""

import jax
import pytest

import eqllm
from eqllm import lora
from eqllm.train.mfu import step_flops

D, L, H, KV, Q, FF, V, T, R = 32, 2, 4, 2, 8, 64, 128, 16, 4


@pytest.fixture(scope="module")
def model():
    cfg = eqllm.zoo.config(
        "llama-nano",
        d_model=D,
        n_layers=L,
        vocab_size=V,
        attention={"n_heads": H, "n_kv_heads": KV},
        mlp={"d_ff": FF},
    )
    return eqllm.CausalLM(cfg, key=jax.random.key(0))


# Matmul parameters by hand: q, k, v, o; gate, up, down; the untied head.
N = L * (D * Q * (H + 2 * KV) + H * Q * D + 3 * D * FF) + D * V
ATTENTION = 12 * L * H * Q * T  # scores and weighted sums, forward and backward


def test_full_training_counts_every_weight_gradient(model):
    flops = step_flops(model, T)
    assert flops.model == flops.hardware == 6 * N + ATTENTION
    assert flops.model == model.config.flops_per_token(T)


def test_lora_step_has_no_weight_gradients_for_the_frozen_base(model):
    adapted = lora.apply(
        model, rank=R, alpha=8, targets=["q_proj", "v_proj"], key=jax.random.key(1)
    )
    n_lora = L * (R * (D + H * Q) + R * (D + KV * Q))  # A [r, in] and B [out, r] per layer
    flops = step_flops(adapted, T)
    assert flops.model == 4 * N + 6 * n_lora + ATTENTION
    assert step_flops(model, T).model - flops.model == 2 * N - 6 * n_lora  # no base weight grads


@pytest.mark.parametrize(
    "remat, recomputed",
    [
        ("none", 0),
        ("dots", 0),
        ("dots_no_batch", ATTENTION // 3),
        ("full", 2 * (N - D * V) + ATTENTION // 3),  # the blocks' forward again, not the head
        ("offload", 2 * (N - D * V) + ATTENTION // 3),  # as "full": only the input's home moves
    ],
)
def test_remat_recomputation_is_hardware_flops_only(model, remat, recomputed):
    flops = step_flops(model.with_config(remat=remat), T)
    assert flops.model == 6 * N + ATTENTION
    assert flops.hardware == flops.model + recomputed
