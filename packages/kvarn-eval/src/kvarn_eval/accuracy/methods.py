"""The methods a benchmark compares, selected by name.

Everything comes from :func:`kvarn_math.baselines.standard_methods` (bf16, fp8, per-token INT4,
every KVarN preset through the real record format, KIVI-style, Hadamard+RTN) plus
:class:`Unquantized`, the float32 cache that shows how far bf16 itself sits from exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from kvarn_math.baselines import Method, standard_methods

__all__ = ["Unquantized", "available_methods", "select_methods", "supported_for"]


@dataclass(frozen=True)
class Unquantized(Method):
    """A float32 cache: K/V pass through unchanged (4 bytes per element)."""

    name: str = "fp32"

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return 2 * 4 * head_dim

    def roundtrip(
        self, k: npt.ArrayLike, v: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        return np.asarray(k, dtype=np.float32), np.asarray(v, dtype=np.float32)


def available_methods(group_size: int = 128) -> dict[str, Method]:
    """Every method by name: ``fp32`` then the standard comparison set."""
    methods: list[Method] = [Unquantized(), *standard_methods(group_size)]
    return {m.name: m for m in methods}


def select_methods(spec: str | Sequence[str], group_size: int = 128) -> list[Method]:
    """Methods named by ``spec``: ``all``, ``kvarn`` (every preset), or comma-separated names.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    table = available_methods(group_size)
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    chosen: list[Method] = []
    for name in filter(None, names):
        if name == "all":
            group = list(table.values())
        elif name == "kvarn":
            group = [m for n, m in table.items() if n.startswith("kvarn_")]
        elif name in table:
            group = [table[name]]
        else:
            raise ValueError(
                f"unknown method {name!r}; expected 'all', 'kvarn' or some of: {', '.join(table)}"
            )
        chosen += [m for m in group if m not in chosen]
    if not chosen:
        raise ValueError(f"no method selected by {spec!r}")
    return chosen


def supported_for(methods: Sequence[Method], head_dim: int) -> tuple[list[Method], dict[str, str]]:
    """Split ``methods`` into those that support ``head_dim`` and ``{name: reason}`` skipped."""
    ok: list[Method] = []
    skipped: dict[str, str] = {}
    for m in methods:
        try:
            m.bytes_per_token_per_head(head_dim)
        except ValueError as exc:
            skipped[m.name] = str(exc)
        else:
            ok.append(m)
    return ok, skipped
