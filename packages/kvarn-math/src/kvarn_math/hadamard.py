"""Hadamard rotation of the channel axis.

KVarN rotates every key (after RoPE) and value by the normalized Sylvester-Hadamard
matrix ``H / sqrt(D)`` before quantizing.  The matrix is orthonormal and symmetric, so it
is its own inverse and ``(q H)(k H)^T = q k^T``: attention scores are unchanged when the
query is rotated by the same matrix.  The rotation spreads outlier channels over all
channels, which makes the per-row ranges of the quantizer tighter.

The fast Walsh-Hadamard transform computes ``x @ H / sqrt(D)`` in ``O(D log D)``.
The optional random-sign variant multiplies by ``diag(signs)`` first (``x @ diag(s) @ H``);
its inverse applies ``H`` and then the signs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "hadamard_matrix",
    "fwht",
    "random_signs",
    "rotate",
    "unrotate",
]


def _check_power_of_two(size: int, what: str = "size") -> None:
    if size < 1 or size & (size - 1):
        raise ValueError(f"{what} must be a power of two >= 1, got {size}")


def hadamard_matrix(size: int) -> npt.NDArray[np.float64]:
    """The normalized Sylvester-Hadamard matrix ``H_size / sqrt(size)``.

    Args:
        size: a power of two.

    Returns:
        ``[size, size]`` float64, symmetric and orthonormal (``H @ H == I``).
    """
    _check_power_of_two(size)
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    out: npt.NDArray[np.float64] = h / np.sqrt(size)
    return out


def fwht(x: npt.ArrayLike, axis: int = -1) -> npt.NDArray[np.floating]:
    """Fast normalized Walsh-Hadamard transform along ``axis``.

    Equal to ``np.moveaxis(np.moveaxis(x, axis, -1) @ hadamard_matrix(D), -1, axis)`` up to
    float rounding, in ``O(D log D)`` per vector.

    Args:
        x: ``[..., D, ...]`` with ``D = x.shape[axis]`` a power of two.  Float inputs keep
            their dtype (float32 stays float32); integer inputs become float64.
        axis: the axis to transform.

    Returns:
        Array of the same shape.
    """
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float64)
    moved = np.moveaxis(arr, axis, -1)
    size = moved.shape[-1]
    _check_power_of_two(size, "the transformed axis")
    lead = moved.shape[:-1]
    out = np.array(moved, copy=True)
    half = 1
    while half < size:
        pairs = out.reshape(*lead, size // (2 * half), 2, half)
        a = pairs[..., 0, :].copy()
        b = pairs[..., 1, :]
        pairs[..., 0, :] = a + b
        pairs[..., 1, :] = a - b
        out = pairs.reshape(*lead, size)
        half *= 2
    out *= out.dtype.type(1.0 / np.sqrt(size))
    return np.moveaxis(out, -1, axis)


def random_signs(size: int, seed: int) -> npt.NDArray[np.float64]:
    """Seeded random +-1 vector ``[size]`` for the random-sign Hadamard variant."""
    _check_power_of_two(size)
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([-1.0, 1.0]), size=size)


def rotate(
    x: npt.ArrayLike, axis: int = -1, signs: npt.NDArray[np.floating] | None = None
) -> npt.NDArray[np.floating]:
    """Rotate ``x`` into the quantization frame: ``x @ diag(signs) @ H`` along ``axis``.

    Args:
        x: ``[..., D, ...]``.
        axis: the channel axis.
        signs: optional ``[D]`` +-1 vector (``random_signs``); ``None`` is plain Hadamard.
    """
    arr = np.asarray(x)
    if signs is not None:
        arr = arr * _broadcast(signs, arr.ndim, axis).astype(arr.dtype, copy=False)
    return fwht(arr, axis)


def unrotate(
    x: npt.ArrayLike, axis: int = -1, signs: npt.NDArray[np.floating] | None = None
) -> npt.NDArray[np.floating]:
    """Inverse of :func:`rotate`: ``x @ H @ diag(signs)`` along ``axis``."""
    out = fwht(x, axis)
    if signs is not None:
        out = out * _broadcast(signs, out.ndim, axis).astype(out.dtype, copy=False)
    return out


def _broadcast(vec: npt.NDArray[np.floating], ndim: int, axis: int) -> npt.NDArray[np.floating]:
    shape = [1] * ndim
    shape[axis] = vec.shape[0]
    return vec.reshape(shape)
