"""Reusable Equinox layers for decoder-only Transformers; they take plain sizes and flags."""

from eqllm.nn.attention import Attention, attention_mask, dot_product_attention
from eqllm.nn.block import Block
from eqllm.nn.fused_attention import fused_attention
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.linear import Embedding, Linear, ParamInfo, param_info
from eqllm.nn.mlp import MLP, GatedMLP
from eqllm.nn.norm import LayerNorm, RMSNorm
from eqllm.nn.rope import RotaryEmbedding, rope_inv_freq

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Embedding",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "Linear",
    "ParamInfo",
    "RMSNorm",
    "RotaryEmbedding",
    "attention_mask",
    "dot_product_attention",
    "fused_attention",
    "param_info",
    "rope_inv_freq",
]
