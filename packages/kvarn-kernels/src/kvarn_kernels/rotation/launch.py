"""Launchers of the Hadamard rotation (``kvarn_math.rotate`` / ``unrotate`` on torch tensors)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch
import triton  # type: ignore[import-untyped]

from kvarn_kernels._guards import MODEL_DTYPES, check_same_device, check_tensor
from kvarn_kernels.rotation.kernel import rotate_rows_kernel

__all__ = ["rotate", "unrotate"]

_MAX_DIM = 512


def _rotate(
    x: torch.Tensor,
    axis: int,
    signs: torch.Tensor | npt.NDArray[np.floating] | None,
    inverse: bool,
) -> torch.Tensor:
    check_tensor("x", x, dtype=MODEL_DTYPES)
    check_same_device(x=x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(
            f"axis must be in [{-x.dim()}, {x.dim()}) for x of shape {list(x.shape)}, got {axis}"
        )
    moved = x.movedim(axis, -1)
    d = moved.shape[-1]
    if d < 2 or d & (d - 1) or d > _MAX_DIM:
        raise ValueError(f"the rotated axis must be a power of two in [2, {_MAX_DIM}], got {d}")
    if signs is not None:
        s = torch.as_tensor(signs, dtype=torch.float32, device=x.device).contiguous()
        check_tensor("signs", s, shape=(d,))
    else:
        s = torch.ones(1, dtype=torch.float32, device=x.device)
    flat = moved.contiguous().reshape(-1, d)
    out = torch.empty_like(flat)
    rows = flat.shape[0]
    if rows:
        block_r = 16
        rotate_rows_kernel[(triton.cdiv(rows, block_r),)](
            flat,
            out,
            s,
            rows,
            float(np.float32(1.0 / math.sqrt(d))),
            D=d,
            BLOCK_R=block_r,
            SIGNS_FIRST=signs is not None and not inverse,
            SIGNS_LAST=signs is not None and inverse,
            num_warps=4,
        )
    return out.reshape(moved.shape).movedim(-1, axis)


def rotate(
    x: torch.Tensor,
    axis: int = -1,
    signs: torch.Tensor | npt.NDArray[np.floating] | None = None,
) -> torch.Tensor:
    """Rotate into the quantization frame: ``x @ diag(signs) @ H / sqrt(D)`` along ``axis``.

    Args:
        x: ``[..., D, ...]`` fp16/bf16/fp32 (computed in fp32, returned in ``x.dtype``).
        axis: the channel axis, ``D`` a power of two <= 512.
        signs: optional ``[D]`` +-1 vector (random-sign variant).

    Returns:
        A new tensor of ``x``'s shape and dtype; fp32 results equal kvarn_math.rotate bit for bit.
    """
    return _rotate(x, axis, signs, inverse=False)


def unrotate(
    x: torch.Tensor,
    axis: int = -1,
    signs: torch.Tensor | npt.NDArray[np.floating] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``x @ H / sqrt(D) @ diag(signs)`` along ``axis``."""
    return _rotate(x, axis, signs, inverse=True)
