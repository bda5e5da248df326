"""Reusable Equinox layers for decoder-only Transformers; they take plain sizes and flags."""

from eqllm.nn.attention import Attention, attention_mask, dot_product_attention
from eqllm.nn.block import Block
from eqllm.nn.kv_cache import KVCache
from eqllm.nn.mlp import MLP, GatedMLP
from eqllm.nn.norm import LayerNorm, RMSNorm
from eqllm.nn.rope import RotaryEmbedding, rope_inv_freq

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "attention_mask",
    "dot_product_attention",
    "rope_inv_freq",
]
