"""A Transformer of one's own, built from eqllm's layers and given eqllm's initialisation,
sharding, weight-decay mask, muP multipliers, LoRA, optimizer and training step, without eqllm's
config or model classes.

docs/modules.md shows this file section by section; tests/test_modules.py and
tests/multidevice/test_own_model_mesh.py run it. `python docs/examples/own_model.py` runs
`main` on 8 devices (simulated on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math
import os
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

from eqllm import lora
from eqllm.nn import Attention, Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from eqllm.parametrization import Scales, init_weights, multipliers
from eqllm.recipe import OptimSpec
from eqllm.sharding import MeshConfig, batch_sharding, make_mesh, param_shardings, shard_model
from eqllm.train import TrainStep, decay_mask, init_opt_state, make_optimizer, schedule

# --8<-- [end:imports]


# --8<-- [start:model]
class Layer(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: GatedMLP

    def __init__(self, d: int, heads: int, attn_scale: float, *, key):
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        rope = RotaryEmbedding(d // heads)
        self.attn = Attention(d, heads, rope=rope, scale=attn_scale, key=k_attn)
        self.mlp = GatedMLP(d, 4 * d, key=k_mlp)

    def __call__(self, x):  # (..., seq, d) -> (..., seq, d)
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(eqx.Module):
    embed: Embedding
    layers: list[Layer]
    norm: RMSNorm
    head: Linear
    readout: float = eqx.field(static=True)  # muP's multiplier on the logits (1 under SP)

    def __init__(self, vocab: int, d: int, heads: int, n_layers: int, scales: Scales, *, key):
        k_embed, k_head, *k_layers = jax.random.split(key, n_layers + 2)
        attn_scale = scales.attention / math.sqrt(d // heads)  # muP: scores ~ 1 / head_dim
        self.embed = Embedding(vocab, d, axes=("vocab", "d_model"), key=k_embed)
        self.layers = [Layer(d, heads, attn_scale, key=k) for k in k_layers]
        self.norm = RMSNorm(d)
        self.head = Linear(d, vocab, axes=("vocab", "d_model"), key=k_head)
        self.readout = scales.readout

    def __call__(self, tokens):  # (..., seq) ids -> (..., seq, vocab) logits
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) * self.readout


# --8<-- [end:model]


# --8<-- [start:build]
def build(key, *, vocab=256, d=64, heads=4, n_layers=2, base_d=32) -> tuple[TinyLM, Scales]:
    """A muP model of width `d` whose settings were tuned at width `base_d`, with eqllm's
    initialisation (its layers' draws until then are placeholders)."""
    scales = Scales.of("mup", n_layers=n_layers, d_model=d, base_d_model=base_d)
    k_model, k_init = jax.random.split(key)
    model = TinyLM(vocab, d, heads, n_layers, scales, key=k_model)
    return init_weights(model, k_init, scales=scales), scales


# --8<-- [end:build]


# --8<-- [start:place]
def place(model, mesh):
    """`model` placed on `mesh`, and the shardings the training step keeps it in."""
    return shard_model(model, mesh), param_shardings(model, mesh)


# --8<-- [end:place]


# --8<-- [start:train]
SPEC = OptimSpec(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.1)


class NextToken:
    """What the step minimises: next-token cross entropy over batch["tokens"] (batch, seq)."""

    def loss(self, model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce, {}


def train(model, scales, batches, *, mesh=None):
    """`model` after one step of eqllm's AdamW (weight decay on the linear layers' matrices,
    muP's per-role learning rate, eps and decay) on each batch, sharded over `mesh` if given;
    and the losses."""
    shardings = None
    if mesh is not None:
        model, shardings = place(model, mesh)
    optimizer = make_optimizer(SPEC, len(batches), model, scales=scales)
    opt_state = init_opt_state(optimizer, model, shardings)
    step = TrainStep(
        optimizer,
        schedule(SPEC, len(batches)),
        objective=NextToken(),
        param_shardings=shardings,
        batch_sharding=None if mesh is None else batch_sharding(mesh),
    )
    losses = []
    for tokens in batches:
        model, opt_state, metrics = step(model, opt_state, {"tokens": tokens})
        losses.append(float(metrics["loss"]))
    return model, losses


# --8<-- [end:train]


# --8<-- [start:lora]
def fine_tune(model, scales, batches, *, mesh=None):
    """Low-rank adapters on the attention's q and v projections (named by the layers' attribute
    names), trained with the rest frozen, then merged back into plain weights."""
    targets = ["q_proj", "v_proj"]
    adapted = lora.apply(model, rank=4, alpha=8, targets=targets, key=jax.random.key(7))
    adapted, losses = train(adapted, scales, batches, mesh=mesh)
    return lora.merge(adapted), losses


# --8<-- [end:lora]


# --8<-- [start:main]
def main(mesh_text: str = "data=2,fsdp=2,tensor=2", steps: int = 20):
    model, scales = build(jax.random.key(0))
    mask = decay_mask(model)  # what AdamW decays: the linear layers' matrices, not embed or norms
    print("decayed: q_proj", mask.layers[0].attn.q_proj.weight, "embed", mask.embed.weight)
    factors = multipliers(model, scales)  # muP's factors on init std, LR, eps and decay
    print("q_proj", factors.layers[0].attn.q_proj.weight)  # lr x 1/2: width 64 over base 32

    mesh = make_mesh(MeshConfig.parse(mesh_text))
    text = np.frombuffer(Path(__file__).read_bytes(), np.uint8).astype(np.int32)  # bytes as ids
    starts = np.random.default_rng(0).integers(0, len(text) - 65, (steps, 8))
    batches = [text[row[:, None] + np.arange(65)] for row in starts]  # 8 windows of 65 a step
    model, losses = train(model, scales, batches, mesh=mesh)
    print(f"trained on {mesh_text}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model, losses = fine_tune(model, scales, batches, mesh=mesh)
    print(f"LoRA fine-tuned and merged: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return model, losses


# --8<-- [end:main]

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    main()
