"""Assertion helpers for comparing kernels with the reference."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvarn_math.metrics import relative_error, sqnr_db

__all__ = ["assert_close_rms", "code_agreement"]


def assert_close_rms(
    ref: npt.ArrayLike,
    approx: npt.ArrayLike,
    max_relative_rms: float,
    min_sqnr_db: float | None = None,
    what: str = "output",
) -> None:
    """Assert ``||ref - approx|| / ||ref|| <= max_relative_rms`` (and an SQNR floor).

    Both must be finite; the message reports the measured values.
    """
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(approx, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {b.shape} != reference shape {a.shape}")
    if not np.isfinite(b).all():
        raise AssertionError(f"{what}: {int((~np.isfinite(b)).sum())} non-finite values")
    err = relative_error(a, b)
    if err > max_relative_rms:
        raise AssertionError(f"{what}: relative RMS error {err:.3e} > {max_relative_rms:.3e}")
    if min_sqnr_db is not None:
        snr = sqnr_db(a, b)
        if snr < min_sqnr_db:
            raise AssertionError(f"{what}: SQNR {snr:.2f} dB < {min_sqnr_db:.2f} dB")


def code_agreement(ref_codes: npt.ArrayLike, codes: npt.ArrayLike) -> float:
    """Fraction of equal integer codes (1.0 when identical)."""
    a = np.asarray(ref_codes)
    b = np.asarray(codes)
    if a.shape != b.shape:
        raise AssertionError(f"codes shape {b.shape} != reference shape {a.shape}")
    return float(np.mean(a == b)) if a.size else 1.0
