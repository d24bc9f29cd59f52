"""Shared summary arithmetic of the accuracy results: mean and standard error, binomial
standard error, item-by-item agreement, and the common shape of a result (rows by method,
``to_dict`` for JSON)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "MethodRows",
    "agreement",
    "binomial_se",
    "mean_and_se",
    "paired_change",
    "weighted_mean_and_se",
]


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (``nan`` error for fewer than two values).

    Args:
        values: the sample.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan
    se = float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else math.nan
    return float(arr.mean()), se


def weighted_mean_and_se(values: Sequence[float], weights: Sequence[float]) -> tuple[float, float]:
    """Weighted mean and its standard error over the sampled units (``nan`` error for fewer
    than two): ``sqrt(n / (n - 1) * sum(w^2 (v - mean)^2)) / sum(w)``, which is
    :func:`mean_and_se`'s for equal weights. Per-chunk means weighted by their token counts give
    the mean over all tokens, with the chunks (items) as the sampling unit.

    Args:
        values: one value per unit.
        weights: one positive weight per unit.
    """
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if v.shape != w.shape:
        raise ValueError(f"need one weight per value, got {w.size} for {v.size}")
    if v.size == 0:
        return math.nan, math.nan
    total = float(w.sum())
    mean = float((w * v).sum() / total)
    if v.size < 2:
        return mean, math.nan
    spread = float((w**2 * (v - mean) ** 2).sum())
    return mean, math.sqrt(v.size / (v.size - 1) * spread) / total


def paired_change(nll: Sequence[float], base: Sequence[float]) -> tuple[float, float]:
    """Perplexity change of per-chunk NLLs ``nll`` against ``base`` on the same chunks, in
    percent, and its standard error (paired chunk by chunk, first-order error propagation).

    Args:
        nll: mean NLL per chunk of the method.
        base: mean NLL per chunk of the baseline, same chunks and order.
    """
    mean, se = mean_and_se([a - b for a, b in zip(nll, base, strict=True)])
    ratio = math.exp(mean)
    return 100.0 * (ratio - 1.0), 100.0 * ratio * se


def binomial_se(p: float, n: int) -> float:
    """Standard error ``sqrt(p (1 - p) / n)`` of a proportion ``p`` over ``n`` items.

    Args:
        p: the proportion.
        n: the number of items (>= 1).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.sqrt(p * (1 - p) / n)


def agreement(predictions: Sequence[Any], reference: Sequence[Any]) -> float:
    """Fraction of items whose prediction equals the reference's.

    Args:
        predictions: one prediction per item.
        reference: the reference's prediction per item (same length).
    """
    if len(predictions) != len(reference) or not reference:
        raise ValueError(
            f"need one prediction per item in both, got {len(predictions)} and {len(reference)}"
        )
    return sum(p == r for p, r in zip(predictions, reference)) / len(reference)


class MethodRows:
    """The common shape of an accuracy result: a dataclass with ``rows``, one per method.

    Subclasses are dataclasses and set ``KIND_KEY`` / ``KIND``: the marker :meth:`to_dict` adds
    so that reports know what the dict holds.
    """

    KIND_KEY: ClassVar[str] = "kind"
    KIND: ClassVar[str] = ""
    rows: Sequence[Any]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form for JSON."""
        data = asdict(self)  # type: ignore[call-overload]
        data[self.KIND_KEY] = self.KIND
        return data

    def row(self, method: str) -> Any:
        """The row of ``method``.

        Args:
            method: the method's name.

        Raises:
            KeyError: no row has that name.
        """
        for r in self.rows:
            if r.method == method:
                return r
        raise KeyError(method)
