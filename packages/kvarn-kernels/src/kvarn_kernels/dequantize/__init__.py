"""Dequantization: tile records back to dense fp16/bf16/fp32 K and V."""

from kvarn_kernels.dequantize.launch import decode_tiles, dequantize, dequantize_tiles

__all__ = ["decode_tiles", "dequantize", "dequantize_tiles"]
