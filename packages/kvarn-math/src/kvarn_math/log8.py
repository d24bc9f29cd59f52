"""One-byte log codes for the positive balancing factors of a tile record.

Variance normalization writes a tile as ``B * r[:, None] * c[None, :]``.  The record keeps the
row factor ``r`` folded into the fp16 RTN step and zero point, and the column factors ``c``
(``k_token_scale`` per token, ``v_channel_scale`` per channel) in one byte each::

    n      = clip(rint(16 * log2(c)) + 16, 0, 255)   # uint8
    factor = exp2(n / 16 - 1)                          # float32, 2^-1 .. 2^14.94

Steps of 2^(1/16) (4.4%).  The encoder rounds the factors *before* it quantizes the rows, so
the codes absorb the rounding and the reconstruction error stays that of the exact factors
(measured: ``recipe_sweep.py --variants log8``).  The range covers every factor the
normalization can return: ``exp(-0.3) .. exp(10)`` is ``2^-0.43 .. 2^14.43``.

``n / 16 - 1`` is exact in float32, so every correct ``exp2`` gives the same factor.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["LOG8_STEPS_PER_OCTAVE", "LOG8_OFFSET", "encode_log8", "decode_log8", "round_log8"]

LOG8_STEPS_PER_OCTAVE = 16
LOG8_OFFSET = 16  # code of the factor 1.0


def encode_log8(factor: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Codes ``n`` (uint8) of positive factors; out-of-range factors saturate to 0 or 255.

    Raises:
        ValueError: if any factor is not positive and finite.
    """
    c = np.asarray(factor, dtype=np.float32)
    if not (np.isfinite(c).all() and (c > 0).all()):
        raise ValueError("log8 factors must be positive and finite")
    n = np.rint(np.float32(LOG8_STEPS_PER_OCTAVE) * np.log2(c)) + np.float32(LOG8_OFFSET)
    out: npt.NDArray[np.uint8] = np.clip(n, 0, 255).astype(np.uint8)
    return out


def decode_log8(codes: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Factors ``exp2(n / 16 - 1)`` (float32) of uint8 codes ``n``."""
    n = np.asarray(codes)
    if n.dtype != np.uint8:
        raise ValueError(f"log8 codes must be uint8, got {n.dtype}")
    e = n.astype(np.float32) * np.float32(1.0 / LOG8_STEPS_PER_OCTAVE) - np.float32(
        LOG8_OFFSET / LOG8_STEPS_PER_OCTAVE
    )
    out: npt.NDArray[np.float32] = np.exp2(e).astype(np.float32)
    return out


def round_log8(factor: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``decode_log8(encode_log8(factor))``: the factor a record will reconstruct with."""
    return decode_log8(encode_log8(factor))
