"""Reusable Equinox layers for decoder-only Transformers; they take plain sizes and flags."""

from eqllm.nn.attention import Attention, attention_mask, dot_product_attention
from eqllm.nn.block import Block
from eqllm.nn.fused_attention import fused_attention
from eqllm.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.linear import (
    Embedding,
    ExpertLinear,
    Int8Embedding,
    Int8Linear,
    Linear,
    quantize,
)
from eqllm.nn.mamba2 import Mamba2
from eqllm.nn.mla import LatentCache, MultiHeadLatentAttention
from eqllm.nn.mlp import MLP, GatedMLP
from eqllm.nn.moe import MoE, Routing
from eqllm.nn.moe_losses import (
    balance_loss,
    balanced_bias,
    chosen_load,
    expert_load,
    load_balancing_loss,
    sequence_balance_loss,
)
from eqllm.nn.norm import LayerNorm, RMSNorm
from eqllm.nn.params import ParamInfo, param_info
from eqllm.nn.per_layer import PerLayerGate, PerLayerInputs
from eqllm.nn.rope import RopeScaling, RotaryEmbedding, rope_frequencies, rope_inv_freq
from eqllm.nn.ssd import Mamba2State

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Embedding",
    "ExpertLinear",
    "GatedDeltaNet",
    "GatedDeltaNetState",
    "GatedMLP",
    "Int8Embedding",
    "Int8Linear",
    "KVCache",
    "LatentCache",
    "LayerNorm",
    "Linear",
    "Mamba2",
    "Mamba2State",
    "MoE",
    "Routing",
    "MultiHeadLatentAttention",
    "ParamInfo",
    "PerLayerGate",
    "PerLayerInputs",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "attention_mask",
    "dot_product_attention",
    "fused_attention",
    "balanced_bias",
    "chosen_load",
    "expert_load",
    "load_balancing_loss",
    "balance_loss",
    "sequence_balance_loss",
    "param_info",
    "quantize",
    "rope_frequencies",
    "rope_inv_freq",
]
