"""Shared summary arithmetic of the accuracy results: mean and standard error, binomial
standard error, item-by-item agreement, and the common shape of a result (rows by method,
``to_dict`` for JSON)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, ClassVar

import numpy as np

__all__ = ["MethodRows", "agreement", "binomial_se", "mean_and_se", "paired_change"]


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
