"""Shapes and allocation of the paged cache and the staging area (pure Python, no CUDA at import).

One layer's cache is ``kv_cache`` uint8 ``[num_blocks, num_kv_heads, tile_bytes]`` (a block is one
tile of ``G`` tokens of one sequence for every KV head, in kvarn-math's record format) plus the
staging area ``[num_slots, 2, S*G, num_kv_heads, head_dim]`` in the model dtype, rotated frame, that
holds the tokens of each request's open tile(s); position ``p`` of a request lives at
``staging[slot, :, p % (S*G)]``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
from kvarn_math.layout import Preset, tile_layout

_Pos = TypeVar("_Pos", np.ndarray, torch.Tensor)

__all__ = [
    "allocate_cache",
    "allocate_staging",
    "cache_shape",
    "staging_bytes",
    "staging_rows",
    "staging_shape",
]


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def cache_shape(
    num_blocks: int, num_kv_heads: int, head_dim: int, preset: str | Preset
) -> tuple[int, int, int]:
    """``(num_blocks, num_kv_heads, tile_bytes)`` of one layer's paged cache."""
    lay = tile_layout(preset, head_dim)
    return (
        _positive("num_blocks", num_blocks),
        _positive("num_kv_heads", num_kv_heads),
        lay.tile_bytes,
    )


def allocate_cache(
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | Preset,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed uint8 cache ``[num_blocks, num_kv_heads, tile_bytes]``."""
    shape = cache_shape(num_blocks, num_kv_heads, head_dim, preset)
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def staging_shape(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | Preset,
    staging_tiles: int = 1,
    sink: bool = False,
) -> tuple[int, int, int, int, int]:
    """``(num_slots, 2, (S + sink)*G, num_kv_heads, head_dim)``; ``S = staging_tiles``, the ring
    (open tiles: 1, or 2 with speculative decoding; plus the recent tiles a plan keeps, see
    ``plan_store(recent_tiles=)``); ``sink``: ``G`` more rows per slot keep each request's exact
    first tile."""
    lay = tile_layout(preset, head_dim)
    _positive("staging_tiles", staging_tiles)
    return (
        _positive("num_slots", num_slots),
        2,
        (staging_tiles + int(bool(sink))) * lay.group_size,
        _positive("num_kv_heads", num_kv_heads),
        head_dim,
    )


def staging_bytes(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | Preset,
    dtype: torch.dtype,
    staging_tiles: int = 1,
    sink: bool = False,
) -> int:
    """Bytes of one layer's staging area (multiply by the number of layers for the budget)."""
    numel = 1
    for s in staging_shape(num_slots, num_kv_heads, head_dim, preset, staging_tiles, sink):
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def allocate_staging(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | Preset,
    dtype: torch.dtype,
    device: torch.device | str,
    staging_tiles: int = 1,
    sink: bool = False,
) -> torch.Tensor:
    """A zeroed staging area of :func:`staging_shape`."""
    shape = staging_shape(num_slots, num_kv_heads, head_dim, preset, staging_tiles, sink)
    return torch.zeros(shape, dtype=dtype, device=device)


def staging_rows(pos: _Pos, ring_tokens: int, sink_rows: int = 0) -> _Pos:
    """Staging rows of positions ``pos`` (NumPy or torch integers): a slot's first
    ``sink_rows`` rows (``G`` with the exact first tile, else 0) hold positions ``p < sink_rows``
    for good, the ring of ``ring_tokens = S*G`` rows after them holds the others at
    ``sink_rows + (p - sink_rows) % ring_tokens``. The kernels' twin is
    ``kvarn_kernels._triton.staging_rows``."""
    wrapped = sink_rows + (pos - sink_rows) % ring_tokens
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sink_rows, pos, wrapped)
    return np.where(pos < sink_rows, pos, wrapped)
