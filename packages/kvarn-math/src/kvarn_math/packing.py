"""Bit packing of integer codes along the last axis.

Codes of ``b`` bits are packed 8 at a time into ``b`` bytes, little-end first: code ``i`` of
a group occupies bits ``[b*i, b*i + b)`` of the group's 64-bit little-endian word.  For
4-bit codes this is "two per byte, even index in the low nibble"; for 2-bit, four per byte,
code 0 in the two lowest bits; for 3-bit, 8 codes in 3 bytes.  Every code length must be a
multiple of 8 (tiles of 64/128 tokens and head dims of 64..512 always are).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvarn_math.rtn import check_bits

__all__ = ["packed_size", "pack", "unpack"]


def packed_size(length: int, bits: int) -> int:
    """Bytes taken by ``length`` codes of ``bits`` bits (``length`` a multiple of 8)."""
    check_bits(bits)
    if length % 8:
        raise ValueError(f"the packed length must be a multiple of 8, got {length}")
    return length * bits // 8


def pack(codes: npt.ArrayLike, bits: int) -> npt.NDArray[np.uint8]:
    """Pack ``codes`` ``[..., L]`` (integers in ``[0, 2^bits)``) to ``[..., L * bits / 8]`` uint8."""
    arr = np.asarray(codes)
    nbytes = packed_size(arr.shape[-1], bits)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**bits):
        raise ValueError(
            f"codes must lie in [0, {2**bits}) for {bits}-bit packing, "
            f"got values in [{arr.min()}, {arr.max()}]"
        )
    groups = arr.astype(np.uint64).reshape(*arr.shape[:-1], arr.shape[-1] // 8, 8)
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits)).astype(np.uint64)
    words = np.bitwise_or.reduce(groups << shifts, axis=-1)
    word_bytes = words.astype("<u8").view(np.uint8).reshape(*words.shape, 8)
    return np.ascontiguousarray(word_bytes[..., :bits].reshape(*arr.shape[:-1], nbytes))


def unpack(packed: npt.ArrayLike, bits: int, length: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack`: ``[..., length * bits / 8]`` uint8 to ``[..., length]`` uint8."""
    data = np.asarray(packed, dtype=np.uint8)
    nbytes = packed_size(length, bits)
    if data.shape[-1] != nbytes:
        raise ValueError(
            f"{length} codes of {bits} bits take {nbytes} bytes, got last axis {data.shape[-1]}"
        )
    lead = data.shape[:-1]
    groups = data.reshape(*lead, length // 8, bits)
    padded = np.zeros((*lead, length // 8, 8), dtype=np.uint8)
    padded[..., :bits] = groups
    words = padded.view("<u8")[..., 0]
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits)).astype(np.uint64)
    mask = np.uint64(2**bits - 1)
    codes = (words[..., None] >> shifts) & mask
    return codes.astype(np.uint8).reshape(*lead, length)
