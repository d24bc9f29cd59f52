"""Synthetic K/V shaped like real attention inputs (NumPy only, no hypothesis)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["synthetic_kv"]

F32 = npt.NDArray[np.float32]


def synthetic_kv(head_dim: int, tokens: int, heads: int, seed: int = 0) -> tuple[F32, F32, F32]:
    """Queries ``[H, 16, D]`` and keys, values ``[T, H, D]``.

    Keys have outlier channels (a few channels with large offsets and scales, as after RoPE in
    real models), values are Gaussian, and the logits ``q.k / sqrt(D)`` have a standard
    deviation near 2 so the softmax is neither flat nor one-hot.
    """
    rng = np.random.default_rng(seed)
    channel_scale = 10.0 ** rng.uniform(-0.5, 0.5, size=head_dim)
    offsets = rng.normal(0.0, 0.5, size=head_dim)
    outliers = rng.choice(head_dim, size=max(1, head_dim // 32), replace=False)
    channel_scale[outliers] *= 8.0
    offsets[outliers] += 6.0 * rng.choice([-1.0, 1.0], size=outliers.size)
    k = rng.standard_normal((tokens, heads, head_dim)) * channel_scale + offsets
    v = rng.standard_normal((tokens, heads, head_dim))
    q = rng.standard_normal((heads, 16, head_dim))
    logits_std = float(np.std(np.einsum("hqd,thd->hqt", q, k) / np.sqrt(head_dim)))
    q *= 2.0 / logits_std
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
