"""Shapes and allocation of the paged cache and the staging area (pure Python, no CUDA at import).

One layer's cache is ``kv_cache`` uint8 ``[num_blocks, num_kv_heads, tile_bytes]`` (a block is one
tile of ``G`` tokens of one sequence for every KV head, in kvarn-math's record format) plus the
staging area ``[num_slots, 2, S*G, num_kv_heads, head_dim]`` in the model dtype, rotated frame, that
holds the tokens of each request's open tile(s); position ``p`` of a request lives at
``staging[slot, :, p % (S*G)]``.

With values-only exact windows (``key_tiles=S_k``, see :func:`staging_shape`) the keys need only
the open tiles: staging is ``[num_slots, S_k*G + (S + sink)*G, num_kv_heads, head_dim]``, the
key ring (position ``p``'s key at row ``p % (S_k*G)``) followed by the value rows (as the
default layout's value half). :func:`staging_view` gives the kernels both row mappings.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import numpy as np
import torch
from kvarn_math.layout import Preset, tile_layout

_Pos = TypeVar("_Pos", np.ndarray, torch.Tensor)

__all__ = [
    "allocate_cache",
    "allocate_frame_queries",
    "allocate_staging",
    "cache_shape",
    "frame_query_shape",
    "staging_bytes",
    "staging_rows",
    "staging_shape",
    "staging_view",
    "StagingView",
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
    key_tiles: int | None = None,
) -> tuple[int, ...]:
    """``(num_slots, 2, (S + sink)*G, num_kv_heads, head_dim)``; ``S = staging_tiles``, the ring
    (open tiles: 1, or 2 with speculative decoding; plus the recent tiles a plan keeps, see
    ``plan_store(recent_tiles=)``); ``sink``: ``G`` more rows per slot keep each request's exact
    first tile.

    ``key_tiles = S_k`` (values-only exact windows, ``plan_store(window_keys=False)``: the keys
    need only the ``S_k = S - R`` open tiles): ``(num_slots, S_k*G + (S + sink)*G,
    num_kv_heads, head_dim)``, the key ring then the value rows."""
    lay = tile_layout(preset, head_dim)
    _positive("staging_tiles", staging_tiles)
    g = lay.group_size
    value_rows = (staging_tiles + int(bool(sink))) * g
    slots, heads = _positive("num_slots", num_slots), _positive("num_kv_heads", num_kv_heads)
    if key_tiles is None:
        return (slots, 2, value_rows, heads, head_dim)
    if not isinstance(key_tiles, int) or not 1 <= key_tiles <= staging_tiles:
        raise ValueError(
            f"key_tiles must be an int in [1, staging_tiles={staging_tiles}], got {key_tiles!r}"
        )
    return (slots, key_tiles * g + value_rows, heads, head_dim)


def staging_bytes(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | Preset,
    dtype: torch.dtype,
    staging_tiles: int = 1,
    sink: bool = False,
    key_tiles: int | None = None,
) -> int:
    """Bytes of one layer's staging area (multiply by the number of layers for the budget)."""
    numel = 1
    shape = staging_shape(num_slots, num_kv_heads, head_dim, preset, staging_tiles, sink, key_tiles)
    for s in shape:
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
    key_tiles: int | None = None,
) -> torch.Tensor:
    """A zeroed staging area of :func:`staging_shape`."""
    shape = staging_shape(num_slots, num_kv_heads, head_dim, preset, staging_tiles, sink, key_tiles)
    return torch.zeros(shape, dtype=dtype, device=device)


def frame_query_shape(
    num_slots: int,
    num_q_heads: int,
    head_dim: int,
    preset: str | Preset,
    staging_tiles: int = 1,
    sink: bool = False,
    key_tiles: int | None = None,
) -> tuple[int, int, int, int]:
    """``(num_slots, T, num_q_heads, head_dim)``: the frame queries that go with a staging area of
    ``staging_shape(num_slots, ..., staging_tiles, sink, key_tiles)``.

    Entry ``[slot, t]`` holds the query (original frame, model dtype) of the position whose key
    sits at key row ``t * G + G - 1`` (the last position of a tile), as
    ``store_kv(frame_queries=)`` staged it with the key. ``T`` is the key rows' tiles:
    ``key_tiles``, else ``staging_tiles + sink``. A speculative step can commit a tile all of
    whose tokens were staged (accepted drafts); ``key_frame="auto"`` then judges it by this
    query, the same query a step that writes the tile's last token directly judges it by.
    """
    # Checks the preset, head_dim, slots and tiles as the staging area's shape does.
    staging_shape(num_slots, 1, head_dim, preset, staging_tiles, sink, key_tiles)
    tiles = key_tiles if key_tiles is not None else staging_tiles + int(bool(sink))
    return (num_slots, tiles, _positive("num_q_heads", num_q_heads), head_dim)


def allocate_frame_queries(
    num_slots: int,
    num_q_heads: int,
    head_dim: int,
    preset: str | Preset,
    dtype: torch.dtype,
    device: torch.device | str,
    staging_tiles: int = 1,
    sink: bool = False,
    key_tiles: int | None = None,
) -> torch.Tensor:
    """A zeroed frame-query area of :func:`frame_query_shape` (``dtype``: the queries')."""
    shape = frame_query_shape(
        num_slots, num_q_heads, head_dim, preset, staging_tiles, sink, key_tiles
    )
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


class StagingView(NamedTuple):
    """How the kernels address one staging area (strides in elements).

    Position ``p``'s key of slot ``s``, KV head ``h`` is at ``s * slot + key_row(p) * row + h *
    head``, its value ``value_offset`` further at ``value_row(p)`` instead; ``key_row`` is
    :func:`staging_rows` with ``(key_ring, key_sink)``, ``value_row`` with ``(ring, sink)``."""

    slot: int
    value_offset: int
    row: int
    head: int
    key_ring: int
    key_sink: int
    ring: int
    sink: int


def staging_view(
    staging: torch.Tensor, group_size: int, sink: bool, key_tiles: int | None
) -> StagingView:
    """The :class:`StagingView` of a staging area of :func:`staging_shape` (``key_tiles`` as
    given there; a 4-D area needs it, a 5-D one must not have it)."""
    sink_rows = group_size if sink else 0
    st = staging.stride()
    if key_tiles is None:
        if staging.dim() != 5:
            raise ValueError(
                f"staging of shape {list(staging.shape)}: a 4-D staging area (values-only exact "
                "windows) needs key_tiles"
            )
        ring = staging.shape[2] - sink_rows
        return StagingView(st[0], st[1], st[2], st[3], ring, sink_rows, ring, sink_rows)
    if staging.dim() != 4:
        raise ValueError(
            f"key_tiles={key_tiles} needs a 4-D staging area (values-only exact windows), got "
            f"shape {list(staging.shape)}"
        )
    key_ring = key_tiles * group_size
    ring = staging.shape[1] - key_ring - sink_rows
    if ring < key_ring:
        raise ValueError(
            f"staging of shape {list(staging.shape)} has {staging.shape[1]} rows, fewer than the "
            f"{key_ring} key rows plus {key_ring + sink_rows} value rows of key_tiles={key_tiles}"
        )
    return StagingView(st[0], key_ring * st[1], st[1], st[2], key_ring, 0, ring, sink_rows)
