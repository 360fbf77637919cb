"""Leaf building blocks; they depend only on torch (and aiayn.config, aiayn.device)."""

from aiayn.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.nn.kv_cache import KVCache, LayerKVCache
from aiayn.nn.kv_memory import kv_cache_bytes
from aiayn.nn.masks import causal_mask, combine_masks, key_mask, valid_tokens
from aiayn.nn.mlp import FeedForward
from aiayn.nn.norm import make_norm
from aiayn.nn.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
    apply_rotary,
    sinusoidal_encoding,
)

__all__ = [
    "ALiBi",
    "FeedForward",
    "KVCache",
    "LayerKVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "apply_rotary",
    "causal_mask",
    "combine_masks",
    "key_mask",
    "kv_cache_bytes",
    "make_norm",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "valid_tokens",
]
