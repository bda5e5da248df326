"""Model FLOPs utilisation: achieved training FLOP/s over the hardware's peak.

FLOPs per token are those the training step performs (`step_flops`): for each matmul parameter,
2 in the forward pass, 2 for the input gradient and 2 for the weight gradient only where the
weight is trained (a LoRA base and a frozen tied head get none: 4 N + 6 N_adapters), plus the
attention scores and weighted sums (12 L H Q T, PaLM appendix B, not halved for the causal mask).
MFU counts these; recomputation under remat is reported apart, as hardware FLOPs utilisation
(HFU: the same plus the recomputed forward). The peak is the published dense bf16 figure for
known GPUs and TPUs (the reference even when a run computes in fp32), and on CPU the best fp32
matmul FLOP/s measured on this machine (measured on each call; the best so far is kept in the
cache folder).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from eqllm import lora
from eqllm.model import CausalLM
from eqllm.resources import cache_root
from eqllm.sharding.tpu import CHIPS as TPU_CHIPS

# Dense bf16 peak FLOP/s per device (not the "with sparsity" figures).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    # TPUs by the device kind JAX reports ("TPU v5" is a v5p), from the one table of TPU chips
    **{chip.device_kind: chip.peak_flops for chip in TPU_CHIPS.values()},
}


def device_peak_flops(device: jax.Device | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from). None when it is unknown."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measure_cpu_peak(), "measured fp32 matmul, best seen on this machine"
    kind = device.device_kind
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name.lower() in kind.lower():
            return PEAK_FLOPS[name], f"published dense bf16 peak of {name}"
    warnings.warn(
        f"no peak FLOP/s figure for device kind {kind!r}: MFU is not reported; add it to "
        "eqllm.train.mfu.PEAK_FLOPS",
        stacklevel=2,
    )
    return None, f"unknown device kind {kind!r}"


def measure_cpu_peak(size: int = 2048, repeats: int = 3, cache: Path | None = None) -> float:
    """FLOP/s of the best fp32 (size x size) matmul seen on this machine, now or before.

    Measured on every call (about a second) and kept as the best figure so far in `cache`: one
    measurement taken while the machine was busy would otherwise understate the peak for good
    and report MFU above 100%.
    """
    cache = cache or cache_root() / "cpu_peak.json"
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{jax.__version__}|{size}"
    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    flops = 2 * size**3 / best
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            flops = max(flops, float(cached["flops"]))
    except (OSError, ValueError, KeyError):
        pass
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "flops": flops}))
    except OSError:
        pass
    return flops


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None, n_devices: int = 1):
    """tokens/s x FLOPs/token / (devices x peak); None when the peak is unknown."""
    if not peak:
        return None
    return tokens_per_second * flops_per_token / (n_devices * peak)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of one training step: `model` (MFU's numerator) and `hardware` (HFU's:
    `model` plus the forward computation remat repeats in the backward pass)."""

    model: float
    hardware: float


def step_flops(model: CausalLM, seq_len: int) -> StepFlops:
    """The FLOPs per token a training step of `model` performs (see the module docstring).

    Matmul parameters are the config's (active experts only; the embedding table only when tied
    into the head). With LoRA adapters the base weights are frozen: no weight gradients, and
    the adapters' own matmuls are added. Under `remat` the recomputed forward counts towards
    `hardware`: the whole block for "full" and "offload", the attention products for
    "dots_no_batch" (only non-batched dots are saved), nothing for "dots".
    """
    cfg = model.config
    attention = cfg.attention_flops_per_token(seq_len)
    base = (cfg.flops_per_token(seq_len) - attention) / 6.0  # matmul parameters per token
    found = lora.adapters(model)
    adapter = float(sum(a.lora_a.weight.size + a.lora_b.weight.size for a in found.values()))
    if found:
        model_flops = 4.0 * base + 6.0 * adapter + attention
    else:
        model_flops = 6.0 * base + attention
    head = cfg.d_model * cfg.vocab_size  # outside the remat'd blocks
    recompute = {
        "none": 0.0,
        "dots": 0.0,
        "dots_no_batch": attention / 3.0,
        "full": 2.0 * (base - head + adapter) + attention / 3.0,
    }
    recompute["offload"] = recompute["full"]  # the same recomputation, its input from the host
    recompute = recompute[cfg.remat]
    return StepFlops(model=model_flops, hardware=model_flops + recompute)
