"""Quantize-on-write: rotate, normalize, round, pack and scatter tiles into the paged cache."""

from kvarn_kernels.quantize.launch import encode_tiles, quantize_tiles, store_kv

__all__ = ["encode_tiles", "quantize_tiles", "store_kv"]
