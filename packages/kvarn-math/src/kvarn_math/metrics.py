"""Error metrics between a reference and its reconstruction."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "mse",
    "sqnr_db",
    "cosine_similarity",
    "relative_error",
    "attention_output_error",
    "kl_divergence",
    "log_softmax",
]


def _pair(
    ref: npt.ArrayLike, approx: npt.ArrayLike
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(approx, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"reference {a.shape} and approximation {b.shape} differ in shape")
    return a, b


def mse(ref: npt.ArrayLike, approx: npt.ArrayLike) -> float:
    """Mean squared error over all elements."""
    a, b = _pair(ref, approx)
    return float(np.mean((a - b) ** 2))


def sqnr_db(ref: npt.ArrayLike, approx: npt.ArrayLike) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum ref^2 / sum (ref - approx)^2)`` in dB.

    ``inf`` for an exact reconstruction.
    """
    a, b = _pair(ref, approx)
    noise = float(np.sum((a - b) ** 2))
    signal = float(np.sum(a**2))
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * float(np.log10(signal / noise))


def cosine_similarity(ref: npt.ArrayLike, approx: npt.ArrayLike) -> float:
    """Cosine similarity of the flattened arrays (1.0 when both are zero)."""
    a, b = _pair(ref, approx)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a.ravel(), b.ravel()) / (na * nb))


def relative_error(ref: npt.ArrayLike, approx: npt.ArrayLike) -> float:
    """``||ref - approx|| / ||ref||`` (Frobenius); 0 when both are zero."""
    a, b = _pair(ref, approx)
    denom = float(np.linalg.norm(a))
    diff = float(np.linalg.norm(a - b))
    if denom == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / denom


def attention_output_error(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    k_hat: npt.ArrayLike,
    v_hat: npt.ArrayLike,
    scale: float | None = None,
) -> float:
    """Relative error of full (non-causal) attention outputs using ``k_hat, v_hat``.

    Args:
        q: ``[..., T_q, D]`` queries.
        k: ``[..., T, D]`` exact keys.
        v: ``[..., T, D]`` exact values.
        k_hat: ``[..., T, D]`` reconstructed keys.
        v_hat: ``[..., T, D]`` reconstructed values.
        scale: softmax scale, default ``1 / sqrt(D)``.
    """

    def attend(kk: npt.ArrayLike, vv: npt.ArrayLike) -> npt.NDArray[np.float64]:
        qq = np.asarray(q, dtype=np.float64)
        s = 1.0 / np.sqrt(qq.shape[-1]) if scale is None else scale
        logits = qq @ np.swapaxes(np.asarray(kk, dtype=np.float64), -1, -2) * s
        probs = np.exp(log_softmax(logits))
        return probs @ np.asarray(vv, dtype=np.float64)

    return relative_error(attend(k, v), attend(k_hat, v_hat))


def log_softmax(logits: npt.ArrayLike, axis: int = -1) -> npt.NDArray[np.float64]:
    """Numerically stable log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=axis, keepdims=True)
    out: npt.NDArray[np.float64] = x - np.log(np.exp(x).sum(axis=axis, keepdims=True))
    return out


def kl_divergence(ref_logits: npt.ArrayLike, approx_logits: npt.ArrayLike, axis: int = -1) -> float:
    """Mean ``KL(softmax(ref) || softmax(approx))`` over all positions, in nats."""
    a, b = _pair(ref_logits, approx_logits)
    lp, lq = log_softmax(a, axis), log_softmax(b, axis)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=axis)
    return float(np.mean(kl))
