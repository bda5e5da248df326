"""Which attention kernel a model runs: `ModelConfig.attention.kernel` resolved against the device.

"xla" is the model's own attention (`eqllm.nn.attention`). "cudnn" is cuDNN's fused kernel through
`jax.nn.dot_product_attention` (`eqllm.nn.fused_attention`), which needs an NVIDIA GPU, bf16/fp16
compute, head_dim a multiple of 8 (at most 256 on Hopper and later, 128 before), no soft-capping of
the scores and no attention sinks (`jax.nn.dot_product_attention` takes no sink logits; gpt-oss
therefore runs the model's own attention). "auto" takes cuDNN where all of that holds and the
model's own attention otherwise: silently on a machine without a GPU, with one log line on a GPU
(the reason, once per family and reason). Asking for "cudnn" where it cannot run is a ConfigError.
"""

from __future__ import annotations

import functools
import logging

import jax

from eqllm.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


def attention_kernel(config: ModelConfig) -> str | None:
    """The `kernel` of the model's Attention layers: "cudnn", or None for the model's own."""
    if config.attention.kernel == "xla":
        return None
    platform, max_head_dim = _device()
    reasons = cudnn_blockers(config, platform, max_head_dim)
    if not reasons:
        return "cudnn"
    if config.attention.kernel == "cudnn":
        raise ConfigError(
            f"ModelConfig.attention.kernel='cudnn' cannot run here: {'; '.join(reasons)}; "
            "use attention.kernel='auto' (cuDNN where it can run) or attention.kernel='xla'"
        )
    if platform in ("cuda", "gpu", "rocm"):
        _say_once(config.family, tuple(reasons))
    return None


def cudnn_blockers(config: ModelConfig, platform: str, max_head_dim: int) -> list[str]:
    """Why cuDNN's fused attention cannot run `config` on `platform` (empty: it can)."""
    reasons = []
    if platform != "cuda":
        reasons.append(f"no NVIDIA GPU (jax's devices are {platform!r})")
    if config.compute_dtype == "float32":
        reasons.append("compute_dtype='float32' (the fused kernel takes bfloat16 or float16)")
    if (cap := config.attention.softcap) is not None:
        reasons.append(f"attention.softcap={cap} (the fused kernel cannot soft-cap)")
    if config.attention.sinks:
        reasons.append("attention.sinks=True (the fused kernel has no sink logits)")
    if (chunk := config.attention.chunk_size) is not None:
        reasons.append(f"attention.chunk_size={chunk} (the fused kernel has no chunked mask)")
    if config.head_dim % 8 or config.head_dim > max_head_dim:
        reasons.append(
            f"head_dim={config.head_dim} (the fused kernel needs a multiple of 8, "
            f"at most {max_head_dim} on this GPU)"
        )
    return reasons


def _device() -> tuple[str, int]:
    """The platform of jax's devices ("cuda" for NVIDIA GPUs) and the largest head_dim cuDNN
    takes there."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # NVIDIA devices only
    if device.platform not in ("gpu", "cuda") or capability is None:
        return device.platform, 256
    major = int(str(capability).split(".")[0])
    return "cuda", 256 if major >= 9 else 128


@functools.cache
def _say_once(family: str, reasons: tuple[str, ...]) -> None:
    log.warning(
        "attention.kernel='auto' uses the model's own (xla) attention for %s: %s",
        family,
        "; ".join(reasons),
    )
