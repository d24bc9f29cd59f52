"""Hadamard rotation of the channel axis (into and out of the quantization frame)."""

from kvarn_kernels.rotation.launch import rotate, unrotate

__all__ = ["rotate", "unrotate"]
