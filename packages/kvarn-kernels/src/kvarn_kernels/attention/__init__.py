"""Attention over the quantized paged cache: decode (split-K) and multi-query (causal)."""

from kvarn_kernels.attention.launch import (
    autotune_enabled,
    choose_num_splits,
    decode_attention,
    multi_query_attention,
)

__all__ = ["autotune_enabled", "choose_num_splits", "decode_attention", "multi_query_attention"]
