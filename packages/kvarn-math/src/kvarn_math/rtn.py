"""Asymmetric round-to-nearest along the last axis (one scale and zero point per row).

For a row ``x[0..C)`` and ``b`` bits::

    lo    = min(x)
    step  = (max(x) - lo) / (2^b - 1)
    q     = clamp(round_half_even((x - lo) / step), 0, 2^b - 1)      (q = 0 where step == 0)
    x_hat = q * step + lo                                             |x - x_hat| <= step / 2

KVarN folds ``step`` and ``lo`` into the normalization scale of the same axis (see
:mod:`kvarn_math.tile`), so the stored tile needs one multiply per element more than RTN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["SUPPORTED_BITS", "RowQuantized", "quantize_rows", "dequantize_rows", "check_bits"]

SUPPORTED_BITS = tuple(range(1, 9))


def check_bits(bits: int, what: str = "bits") -> None:
    """Raise ``ValueError`` unless ``bits`` is an integer in 1..8."""
    if not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"{what} must be one of {SUPPORTED_BITS}, got {bits!r}")


@dataclass(frozen=True)
class RowQuantized:
    """Codes and per-row parameters.

    Attributes:
        codes: ``[..., R, C]`` uint8 in ``[0, 2^bits)``.
        step: ``[..., R]`` float32, ``>= 0``.
        lo: ``[..., R]`` float32, the row minimum.
        bits: bit width.
    """

    codes: npt.NDArray[np.uint8]
    step: npt.NDArray[np.float32]
    lo: npt.NDArray[np.float32]
    bits: int


def quantize_rows(x: npt.ArrayLike, bits: int) -> RowQuantized:
    """Quantize each row of ``x`` ``[..., R, C]`` (float32 arithmetic) to ``bits`` bits."""
    check_bits(bits)
    arr = np.asarray(x, dtype=np.float32)
    levels = np.float32(2**bits - 1)
    lo = arr.min(axis=-1)
    step = ((arr.max(axis=-1) - lo) / levels).astype(np.float32)
    safe = np.where(step > 0, step, np.float32(1.0))
    scaled = (arr - lo[..., None]) / safe[..., None]
    codes = np.clip(np.rint(scaled), 0, levels)
    codes = np.where(step[..., None] > 0, codes, 0).astype(np.uint8)
    return RowQuantized(codes=codes, step=step, lo=lo.astype(np.float32), bits=int(bits))


def dequantize_rows(q: RowQuantized) -> npt.NDArray[np.float32]:
    """``codes * step + lo`` as float32 ``[..., R, C]``."""
    return (q.codes.astype(np.float32) * q.step[..., None] + q.lo[..., None]).astype(np.float32)
