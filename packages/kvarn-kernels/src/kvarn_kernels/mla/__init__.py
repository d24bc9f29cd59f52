"""MLA latent cache: quantize-on-write, decode attention in latent space, dequantize/gather."""

from kvarn_kernels.mla.launch import (
    allocate_mla_cache,
    choose_mla_splits,
    default_heads_per_program,
    dequantize_latent,
    mla_cache_shape,
    mla_decode_attention,
    stage_latent,
    store_latent,
)

__all__ = [
    "allocate_mla_cache",
    "choose_mla_splits",
    "default_heads_per_program",
    "dequantize_latent",
    "mla_cache_shape",
    "mla_decode_attention",
    "stage_latent",
    "store_latent",
]
