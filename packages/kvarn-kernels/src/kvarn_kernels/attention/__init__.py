"""Attention over the quantized paged cache: decode (split-K) and multi-query (causal)."""

from kvarn_kernels.attention.launch import (
    autotune_enabled,
    choose_num_splits,
    decode_attention,
    multi_query_attention,
)
from kvarn_kernels.attention.wrapper import AttentionPlan, plan_attention

__all__ = [
    "AttentionPlan",
    "autotune_enabled",
    "choose_num_splits",
    "decode_attention",
    "multi_query_attention",
    "plan_attention",
]
