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

__all__ = [
    "SUPPORTED_BITS",
    "RowQuantized",
    "quantize_rows",
    "dequantize_rows",
    "check_bits",
    "check_all_finite",
]

SUPPORTED_BITS = tuple(range(1, 9))


def check_bits(bits: int, what: str = "bits") -> None:
    """Raise ``ValueError`` unless ``bits`` is an integer in 1..8."""
    if not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"{what} must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_all_finite(x: npt.NDArray[np.floating], name: str, what: str) -> None:
    """Raise ``ValueError`` naming the index and value of ``x``'s first NaN or infinity.

    Args:
        x: any shape.
        name: what ``x`` is called in the message.
        what: what must be finite (``"rows"``, ``"tiles"``).
    """
    bad = ~np.isfinite(x)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} holds {x[index]} at {index}; {what} must be finite")


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


def quantize_rows(x: npt.ArrayLike, bits: int, clip_ratios: tuple[float, ...] = ()) -> RowQuantized:
    """Quantize each row of ``x`` ``[..., R, C]`` (float32 arithmetic) to ``bits`` bits.

    Args:
        x: ``[..., R, C]``.
        bits: 1..8.
        clip_ratios: experimental (not part of any preset): also try each row's range shrunk
            about its midpoint by these factors (e.g. ``(0.9, 0.8)``) and keep, per row, the
            candidate with the least squared error.  ``()`` is plain min/max RTN.

    Raises:
        ValueError: bits outside 1..8, fewer than two axes or no column, NaN or infinity.
    """
    check_bits(bits)
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim < 2 or arr.shape[-1] < 1:
        raise ValueError(f"x must be [..., R, C] with C >= 1, got shape {arr.shape}")
    check_all_finite(arr, "x", "rows")
    if clip_ratios:
        return _quantize_rows_clipped(arr, bits, clip_ratios)
    levels = np.float32(2**bits - 1)
    lo = arr.min(axis=-1)
    step = ((arr.max(axis=-1) - lo) / levels).astype(np.float32)
    return _round(arr, lo, step, bits)


def _round(
    arr: npt.NDArray[np.float32],
    lo: npt.NDArray[np.float32],
    step: npt.NDArray[np.float32],
    bits: int,
) -> RowQuantized:
    levels = np.float32(2**bits - 1)
    safe = np.where(step > 0, step, np.float32(1.0))
    scaled = (arr - lo[..., None]) / safe[..., None]
    codes = np.clip(np.rint(scaled), 0, levels)
    codes = np.where(step[..., None] > 0, codes, 0).astype(np.uint8)
    return RowQuantized(codes=codes, step=step, lo=lo.astype(np.float32), bits=int(bits))


def _quantize_rows_clipped(
    arr: npt.NDArray[np.float32], bits: int, clip_ratios: tuple[float, ...]
) -> RowQuantized:
    levels = np.float32(2**bits - 1)
    lo0, hi0 = arr.min(axis=-1), arr.max(axis=-1)
    mid, half = (lo0 + hi0) / 2, (hi0 - lo0) / 2
    best: RowQuantized | None = None
    best_err: npt.NDArray[np.float32] = np.full(arr.shape[:-1], np.inf, dtype=np.float32)
    for ratio in (1.0, *clip_ratios):
        if not 0 < ratio <= 1:
            raise ValueError(f"clip ratios must lie in (0, 1], got {ratio}")
        lo = (mid - np.float32(ratio) * half).astype(np.float32)
        step = (np.float32(2 * ratio) * half / levels).astype(np.float32)
        cand = _round(arr, lo, step, bits)
        err: npt.NDArray[np.float32] = np.asarray(
            np.sum((dequantize_rows(cand) - arr) ** 2, axis=-1, dtype=np.float32)
        )
        if best is None:
            best, best_err = cand, err
            continue
        take = err < best_err
        best = RowQuantized(
            codes=np.where(take[..., None], cand.codes, best.codes),
            step=np.where(take, cand.step, best.step),
            lo=np.where(take, cand.lo, best.lo),
            bits=bits,
        )
        best_err = np.where(take, err, best_err)
    assert best is not None
    return best


def dequantize_rows(q: RowQuantized) -> npt.NDArray[np.float32]:
    """``codes * step + lo`` as float32 ``[..., R, C]``."""
    return (q.codes.astype(np.float32) * q.step[..., None] + q.lo[..., None]).astype(np.float32)
