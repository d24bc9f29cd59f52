"""The per-step store plan: which fresh tokens go to staging, which tiles are quantized.

Computed once per step on the host (pure NumPy), moved to the GPU once, used by every layer's
:func:`kvarn_kernels.store_kv`.  For each request, with ``G`` the tile size and ``S*G`` the staging
positions per slot:

* ``q_before`` (``num_quantized``): tokens already in quantized tiles, a multiple of ``G``;
* ``q_after = max(q_before, floor(num_committed / G) * G)``: a tile is quantized in the first step
  in which all its tokens are committed, so a rejected speculative token never reaches a record;
* tiles ``[q_before / G, q_after / G)`` are quantized this step: token ``p`` of such a tile comes
  from staging when ``p < num_cached`` (written by an earlier step), else from the fresh batch;
* fresh tokens at positions ``p >= q_after`` are written to ``staging[slot, :, p % (S*G)]``;
* afterwards staging holds ``[q_after, seq_len)``, which must fit: ``seq_len - q_after <= S*G``.

With ``sink=True`` the staging of a slot has ``G`` more rows in front: tile 0 (the attention
sink) is staged there too, for good, and stays exact for attention while its quantized record
serves prefix-cache hits. Position ``p`` then lives at row ``p`` for ``p < G`` and at
``G + (p - G) % (S*G)`` after, and the ring must hold ``[max(q_after, G), seq_len)``.

With ``recent_tiles = R`` the ``R`` complete tiles before the step's first new token stay in
the ring besides their records, so attention reads them exact: the plan's ``read_lens``
(:func:`kvarn_math.recent_window_start`) is
``min(q_after, max(exact_start, (num_cached // G - R) * G, ceil((seq_len - S*G) / G) * G))``,
where ``exact_start`` is the first position the request wrote itself (after any prefix-cache
hit; tiles before it exist only as records) and the last term keeps what is read inside the
ring. Fresh tokens from ``read_lens`` on are written to staging, which then holds
``[read_lens, seq_len)``. The open tiles have ``(S - R) * G`` positions.

With ``window_keys=False`` the exact windows (sink, recent tiles) keep only their values
(:func:`kvarn_math.quantize_sequence`): the keys have their own ring of the ``S_k = S - R`` open
tiles, without sink rows (staging of :func:`kvarn_kernels.staging_shape` with ``key_tiles=S_k``;
position ``p``'s key at row ``p % (S_k*G)``), and attention reads keys from records up to the
plan's ``key_read_lens`` (:func:`kvarn_math.key_window_start`: the step's own tile on), values up
to ``read_lens``. A write row's ``key_pos`` is -1 for a token whose key is not staged.

:func:`plan_store_device` makes the same plan with torch ops on whatever device its inputs live
on, without a host synchronization and with fixed output shapes: for engines whose host view of
the lengths is only an upper bound (speculative decoding with asynchronous scheduling, where the
number of accepted drafts is known only on the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.layout import Preset, get_preset

from kvarn_kernels import settings
from kvarn_kernels._triton import INTERPRET
from kvarn_kernels.cache import staging_rows

__all__ = [
    "TILE_FIELDS",
    "WRITE_FIELDS",
    "StorePlan",
    "plan_store",
    "plan_draft_device",
    "plan_store_device",
    "key_window_start",
    "window_start",
]

TILE_FIELDS = ("block_id", "slot", "start_pos", "num_staged", "fresh_index")
WRITE_FIELDS = ("token_index", "slot", "staging_pos", "key_pos")

IntArray = npt.NDArray[np.int64]
LensT = TypeVar("LensT", torch.Tensor, IntArray)
_PLAN_BLOCK = 128  # rows of tiles / writes per program, and rows per pass of the row walk


@dataclass(frozen=True)
class StorePlan:
    """What :func:`kvarn_kernels.store_kv` does in one step (int32 tensors, host or device).

    Attributes:
        tiles: int32 ``[max_tiles, 5]``: ``block_id`` (-1 = padding, skipped), ``slot``,
            ``start_pos`` (position of the tile's first token), ``num_staged`` (its first
            ``num_staged`` tokens come from staging), ``fresh_index`` (batch row of its first
            fresh token; the others follow contiguously; when every token is staged, its
            request's first row of the step).
        writes: int32 ``[max_writes, 4]``: ``token_index`` (-1 = padding), ``slot``,
            ``staging_pos`` (the value's staging row: ``p % (S*G)``, or with ``sink`` see
            above; -1 when only the key is staged), ``key_pos`` (the key's row:
            ``staging_pos``, or with ``window_keys=False`` ``p % (S_k*G)`` in the key ring;
            -1 when the key is not staged).
        seq_lens: int32 ``[B]``, ``num_cached + num_new``.
        quantized_lens: int32 ``[B]``, tokens in quantized tiles after the step (the next
            step's ``num_quantized``; attention's ``quantized_lens`` without recent tiles).
        num_tiles: real entries of ``tiles``.
        num_writes: real entries of ``writes``.
        group_size: ``G`` of the preset it was planned for.
        staging_tiles: ``S``, tiles of the ring per slot (the open ones and ``recent_tiles``).
        sink: staging has the ``G`` sink rows in front (tile 0 kept exact).
        recent_tiles: ``R``, complete tiles kept in the ring besides their records.
        read_lens: int32 ``[B]`` tokens attention should read from records (the rest from
            staging): ``quantized_lens`` without recent tiles; None is the same. With
            ``window_keys=False``, the values' boundary.
        window_keys: the exact windows keep keys too (default); ``False``: values only.
        key_read_lens: int32 ``[B]`` with ``window_keys=False``: attention reads keys from
            records before it, from the key ring from there on; else None (``read_lens``).
    """

    tiles: torch.Tensor
    writes: torch.Tensor
    seq_lens: torch.Tensor
    quantized_lens: torch.Tensor
    num_tiles: int
    num_writes: int
    group_size: int
    staging_tiles: int
    sink: bool = False
    recent_tiles: int = 0
    read_lens: torch.Tensor | None = None
    window_keys: bool = True
    key_read_lens: torch.Tensor | None = None

    @property
    def attention_lens(self) -> torch.Tensor:
        """``read_lens``, or ``quantized_lens`` when the plan keeps no recent tiles."""
        return self.quantized_lens if self.read_lens is None else self.read_lens

    @property
    def key_tiles(self) -> int | None:
        """``S_k = S - R``, the key ring's tiles with ``window_keys=False``; else None (the
        ``key_tiles`` of :func:`kvarn_kernels.staging_shape` and the attention launchers)."""
        return None if self.window_keys else self.staging_tiles - self.recent_tiles

    def to(self, device: torch.device | str, non_blocking: bool = True) -> StorePlan:
        """The same plan with every tensor on ``device`` (pin the host tensors for async copies)."""
        return replace(
            self,
            tiles=self.tiles.to(device, non_blocking=non_blocking),
            writes=self.writes.to(device, non_blocking=non_blocking),
            seq_lens=self.seq_lens.to(device, non_blocking=non_blocking),
            quantized_lens=self.quantized_lens.to(device, non_blocking=non_blocking),
            read_lens=None
            if self.read_lens is None
            else self.read_lens.to(device, non_blocking=non_blocking),
            key_read_lens=None
            if self.key_read_lens is None
            else self.key_read_lens.to(device, non_blocking=non_blocking),
        )


def _ints(name: str, values: object, length: int | None = None) -> IntArray:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} must be on the host (plan_store runs on the CPU), got {values.device}"
            )
        values = values.numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(
            f"{name} must be a 1-D sequence of ints, got {arr.dtype} shape {arr.shape}"
        )
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries (one per request), got {arr.shape[0]}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {arr.min()}")
    return arr.astype(np.int64)


def plan_store(
    num_cached: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor,
    num_new: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor,
    num_committed: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor | None,
    staging_slots: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor,
    block_table: Sequence[Sequence[int]] | npt.NDArray[np.integer] | torch.Tensor,
    preset: str | Preset,
    *,
    staging_tiles: int = 1,
    num_quantized: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor | None = None,
    query_start_loc: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor | None = None,
    max_tiles: int | None = None,
    max_writes: int | None = None,
    sink: bool = False,
    recent_tiles: int = 0,
    exact_start: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor | None = None,
    window_keys: bool = True,
) -> StorePlan:
    """Plan one step's store for a batch of ``B`` requests (host only, no GPU work).

    Args:
        num_cached: ``[B]`` tokens of each request written before the step (cache + staging).
        num_new: ``[B]`` fresh tokens of each request in this step's ``key``/``value`` batch.
        num_committed: ``[B]`` tokens that can never be rejected after the step, in
            ``[num_cached, num_cached + num_new]``; ``None``: all of them (no speculation).
        staging_slots: ``[B]`` each request's staging slot.
        block_table: ``[B, max_blocks]`` host ints; tile ``t`` of request ``b`` is block
            ``block_table[b, t]``.
        preset: the cache preset (gives ``G``).
        staging_tiles: ``S``; staging holds ``S*G`` positions per slot.
        num_quantized: ``[B]`` tokens in quantized tiles before the step (multiple of ``G``);
            ``None``: ``floor(num_cached / G) * G``, right without speculative decoding.  With
            it, pass the previous step's ``quantized_lens``.
        query_start_loc: ``[B+1]`` first batch row of each request's fresh tokens; default
            ``cumsum(num_new)`` with a leading 0.
        max_tiles: pad ``tiles``/``writes`` to this many rows (fixed shapes for
        max_writes: pad ``tiles``/``writes`` to this many rows (fixed shapes for
            CUDA graphs); padding rows hold -1 and are skipped.
        sink: keep tile 0 exact in ``G`` sink rows in front of the staging ring (see the
            module docstring); staging then has ``(S + 1) * G`` positions per slot.
        recent_tiles: ``R`` in ``[0, S)``: keep the ``R`` complete tiles before the step's
            first new token in the ring too (see the module docstring); the open tiles get
            ``(S - R) * G`` positions.
        exact_start: ``[B]`` the first position each request wrote itself (its prefix-cache
            hit length, a multiple of ``G``); default ``floor(num_cached / G) * G``, which is
            safe but keeps no recent tile before this step's. Only matters with recent tiles.
        window_keys: ``False``: the sink and the recent tiles keep only their values exact,
            the keys a ring of the ``S - R`` open tiles (see the module docstring).

    Returns:
        :class:`StorePlan` with CPU tensors (call ``.to(device)``).

    Raises:
        ValueError: on inconsistent inputs, a missing block-table entry, staging overflow
            (``seq_len - quantized_len > S*G``) or padding smaller than the real count.
    """
    p = get_preset(preset)
    g = p.group_size
    if not isinstance(staging_tiles, int) or staging_tiles < 1:
        raise ValueError(f"staging_tiles must be a positive int, got {staging_tiles!r}")
    sg = staging_tiles * g
    if not isinstance(recent_tiles, int) or not 0 <= recent_tiles < staging_tiles:
        raise ValueError(
            f"recent_tiles must be an int in [0, staging_tiles={staging_tiles}), got "
            f"{recent_tiles!r}"
        )
    open_cap = sg - recent_tiles * g  # positions of the open tiles
    cached = _ints("num_cached", num_cached)
    b = cached.shape[0]
    new = _ints("num_new", num_new, b)
    total = cached + new
    committed = total.copy() if num_committed is None else _ints("num_committed", num_committed, b)
    slots = _ints("staging_slots", staging_slots, b)
    if isinstance(block_table, torch.Tensor):
        if block_table.device.type != "cpu":
            raise ValueError(
                f"block_table must be on the host for plan_store, got {block_table.device}"
            )
        table = block_table.numpy()
    else:
        table = np.asarray(block_table)
    if table.ndim != 2 or table.shape[0] < b:
        raise ValueError(f"block_table must be [B={b}, max_blocks] ints, got shape {table.shape}")
    quant = cached // g * g if num_quantized is None else _ints("num_quantized", num_quantized, b)
    if query_start_loc is None:
        qstart = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    else:
        qstart = _ints("query_start_loc", query_start_loc, b + 1)
        if np.any(qstart[1:] - qstart[:-1] < new):
            raise ValueError("query_start_loc must leave num_new rows for every request")

    bad = np.flatnonzero((committed < cached) | (committed > total))
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"num_committed[{i}] must lie in [num_cached, num_cached + num_new] = "
            f"[{cached[i]}, {total[i]}], got {committed[i]}"
        )
    bad = np.flatnonzero((quant % g != 0) | (quant > cached))
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"num_quantized[{i}] must be a multiple of G={g} and <= num_cached={cached[i]}, "
            f"got {quant[i]}"
        )
    # rows [0, base) hold tile 0 for good; the ring starts after (keys have no sink rows
    # with values-only windows, so their open tiles are counted from the quantized tiles)
    base = g if sink else 0
    kbase = base if window_keys else 0
    bad = np.flatnonzero(cached - np.maximum(quant, kbase) > open_cap)
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"request {i}: {cached[i] - quant[i]} cached tokens are not quantized, more than the "
            f"{open_cap} staging positions for open tiles ((S - R)*G) could hold"
        )
    q_after = np.maximum(quant, committed // g * g)
    bad = np.flatnonzero(total - np.maximum(q_after, kbase) > open_cap)
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"request {i}: after the step {total[i] - q_after[i]} tokens would be unquantized "
            f"(seq_len {total[i]}, quantized {q_after[i]}), more than the {open_cap} staging "
            f"positions for open tiles ((S - R)*G = ({staging_tiles} - {recent_tiles})*{g}); "
            "raise staging_tiles"
        )
    if exact_start is None:
        start_exact = cached // g * g
    else:
        start_exact = _ints("exact_start", exact_start, b)
        bad = np.flatnonzero((start_exact % g != 0) | (start_exact > cached))
        if bad.size:
            i = bad[0]
            raise ValueError(
                f"exact_start[{i}] must be a multiple of G={g} and <= num_cached={cached[i]}, "
                f"got {start_exact[i]}"
            )
    # Attention reads [read, seq_len) exact (kvarn_math.recent_window_start); the fresh tokens
    # from there on go to staging, so it holds [read, seq_len) after the step.
    read = window_start(cached, total, q_after, start_exact, g, recent_tiles, staging_tiles)
    key_tiles = staging_tiles - recent_tiles
    key_read = (
        read if window_keys else key_window_start(cached, total, q_after, start_exact, g, key_tiles)
    )

    # Vectorized over requests (a decode step of hundreds of requests costs tens of us).
    first, last = quant // g, q_after // g
    bad = np.flatnonzero(last > table.shape[1])
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"request {i} needs {last[i]} blocks but block_table has {table.shape[1]} columns"
        )
    req, t = _expand(first, last - first)
    start = t * g
    staged = np.clip(cached[req] - start, 0, g)
    # a tile with no fresh token points at its request's first row (whose queries choose its
    # key frame with key_frame="auto")
    fresh = np.where(staged < g, qstart[req] + start + staged - cached[req], qstart[req])
    block = table[req, t].astype(np.int64) if req.size else np.zeros(0, dtype=np.int64)
    bad = np.flatnonzero(block < 0)
    if bad.size:
        i, col = int(req[bad[0]]), int(t[bad[0]])
        raise ValueError(
            f"request {i}: block_table[{i}, {col}] is {block[bad[0]]}, a tile needs a block"
        )
    tiles = np.stack([block, slots[req], start, staged, fresh], axis=1).reshape(-1, 5)

    # Fresh tokens staged: those attention reads exact (values from `read` on, keys from
    # `key_read` on), and with a sink those of tile 0.
    lo = np.where(cached < base, cached, np.maximum(cached, np.minimum(read, key_read)))
    wreq, pos = _expand(lo, np.maximum(total - lo, 0))
    value_kept = (pos >= read[wreq]) | (pos < base)
    keep = value_kept | (pos >= key_read[wreq])
    wreq, pos, value_kept = wreq[keep], pos[keep], value_kept[keep]
    rows = np.where(value_kept, staging_rows(pos, sg, base), -1)
    key_rows = _key_rows(pos, key_read[wreq], rows, key_tiles * g, window_keys)
    writes = np.stack(
        [qstart[wreq] + pos - cached[wreq], slots[wreq], rows, key_rows], axis=1
    ).reshape(-1, 4)

    num_tiles, num_writes = tiles.shape[0], writes.shape[0]
    tiles = _pad("max_tiles", tiles, max_tiles)
    writes = _pad("max_writes", writes, max_writes)
    if max(int(np.abs(tiles).max(initial=0)), int(np.abs(writes).max(initial=0))) >= 2**31:
        raise ValueError("plan entries exceed int32 (positions or token indices >= 2**31)")
    return StorePlan(
        tiles=torch.from_numpy(tiles.astype(np.int32)),
        writes=torch.from_numpy(writes.astype(np.int32)),
        seq_lens=torch.from_numpy(total.astype(np.int32)),
        quantized_lens=torch.from_numpy(q_after.astype(np.int32)),
        num_tiles=num_tiles,
        num_writes=num_writes,
        group_size=g,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=recent_tiles,
        read_lens=torch.from_numpy(read.astype(np.int32)) if recent_tiles else None,
        window_keys=bool(window_keys),
        key_read_lens=None if window_keys else torch.from_numpy(key_read.astype(np.int32)),
    )


def _key_rows(pos: LensT, key_read: LensT, rows: LensT, key_ring: int, window_keys: bool) -> LensT:
    """Write rows' ``key_pos``: the value's row with window keys (where the key is read from
    ``read``, as the value), else the key ring's row of the positions from ``key_read`` on
    and -1 before."""
    if window_keys:
        return rows
    ring = pos % key_ring
    if isinstance(pos, torch.Tensor):
        return torch.where(pos >= key_read, ring, -1)
    return np.where(pos >= key_read, ring, -1)


def _expand(starts: IntArray, counts: IntArray) -> tuple[IntArray, IntArray]:
    """``(owner, value)``: for each i, the values ``starts[i] .. starts[i] + counts[i] - 1``."""
    owner = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    offsets = np.cumsum(counts) - counts
    value = starts[owner] + np.arange(owner.shape[0], dtype=np.int64) - offsets[owner]
    return owner, value


def _pad(name: str, rows: IntArray, size: int | None) -> IntArray:
    if size is None:
        return rows
    if size < rows.shape[0]:
        raise ValueError(f"{name}={size} is smaller than the {rows.shape[0]} entries of this step")
    out = np.full((size, rows.shape[1]), -1, dtype=np.int64)
    out[: rows.shape[0]] = rows
    return out


def window_start(
    num_cached: LensT,
    seq_lens: LensT,
    quantized_lens: LensT,
    exact_start: LensT,
    group_size: int,
    recent_tiles: int,
    staging_tiles: int,
) -> LensT:
    """:func:`kvarn_math.recent_window_start` for ``[B]`` int tensors (any device) or arrays."""
    if not recent_tiles:
        return quantized_lens
    g = group_size
    if isinstance(quantized_lens, torch.Tensor):
        hi, lo = torch.maximum, torch.minimum
    else:
        hi, lo = np.maximum, np.minimum
    window = (num_cached // g - recent_tiles) * g
    ring = -((staging_tiles * g - seq_lens) // g) * g  # whole tiles of the last S*G positions
    return lo(quantized_lens, hi(hi(exact_start, window), ring))


def key_window_start(
    num_cached: LensT,
    seq_lens: LensT,
    quantized_lens: LensT,
    exact_start: LensT,
    group_size: int,
    open_tiles: int,
) -> LensT:
    """:func:`kvarn_math.key_window_start` for ``[B]`` int tensors (any device) or arrays."""
    g = group_size
    if isinstance(quantized_lens, torch.Tensor):
        hi, lo = torch.maximum, torch.minimum
    else:
        hi, lo = np.maximum, np.minimum
    ring = -((open_tiles * g - seq_lens) // g) * g  # whole tiles of the last S_k*G positions
    return lo(quantized_lens, hi(hi(exact_start, num_cached // g * g), ring))


def plan_store_device(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_drafts: torch.Tensor,
    num_quantized: torch.Tensor,
    staging_slots: torch.Tensor,
    block_table: torch.Tensor,
    preset: str | Preset,
    *,
    staging_tiles: int,
    max_tiles: int,
    max_writes: int,
    sink: bool = False,
    recent_tiles: int = 0,
    exact_start: torch.Tensor | None = None,
    window_keys: bool = True,
    out: StorePlan | None = None,
) -> StorePlan:
    """:func:`plan_store` computed on the device from the step's real lengths (no host sync).

    Every output has a fixed shape (``max_tiles``, ``max_writes``) and every decision (which
    tiles are committed, which tokens go to staging) is made from device tensors, so the plan
    can be built while the host only knows upper bounds of the lengths, and inside a CUDA
    graph capture. Rows of ``tiles`` and ``writes`` that are not needed hold -1 (skipped by
    :func:`kvarn_kernels.store_kv`); unlike :func:`plan_store`, skipped write rows can sit
    between real ones.

    Args:
        seq_lens: ``[B]`` int tokens of each request after the step (real, not an upper
            bound); 0 for a padding row.
        query_start_loc: ``[B+1]`` int first batch row of each request's fresh tokens; the
            request has ``query_start_loc[b+1] - query_start_loc[b]`` fresh tokens (its last
            ones, positions ``seq_len - num_new .. seq_len - 1``).
        num_drafts: ``[B]`` int how many of the request's last fresh tokens are unverified
            speculative drafts (0 without speculation). The other tokens are committed:
            ``num_committed = seq_len - num_drafts``.
        num_quantized: ``[B]`` int tokens in quantized tiles before the step (a multiple of
            ``G``, the previous step's ``quantized_lens`` for the request).
        staging_slots: ``[B]`` int each request's staging slot.
        block_table: ``[B, max_blocks]`` int block ids (or any int code the caller maps
            afterwards) on the same device.
        preset: the cache preset (gives ``G``).
        staging_tiles: ``S``; staging holds ``S*G`` positions per slot. The caller must size it
            so that ``seq_len - quantized_len <= S*G`` after every step (not checked here: that
            would need a host sync).
        max_tiles: rows of ``tiles``; at least the number of tiles committed this step.
        max_writes: rows of ``writes``; at least the number of fresh tokens
            (``query_start_loc[B]``). Token ``i`` of the batch owns write row ``i``.
        sink: as :func:`plan_store`.
        recent_tiles: as :func:`plan_store`; the open tiles get ``(S - R) * G`` positions.
        exact_start: ``[B]`` int, as :func:`plan_store` (default: the row's first cached
            position rounded down to a tile).
        window_keys: as :func:`plan_store`.
        out: a plan whose tensors are written in place (e.g. views of a CUDA graph's
            buffers): ``tiles`` ``[max_tiles, 5]``, ``writes`` ``[max_writes, 4]``,
            ``seq_lens``, ``quantized_lens``, ``read_lens`` (always written: the attention
            lengths, ``quantized_lens`` without recent tiles) and, exactly with
            ``window_keys=False``, ``key_read_lens``, all int32 ``[B]``. ``None``: allocated.

    Returns:
        :class:`StorePlan` on the inputs' device (on ``out``'s tensors when given);
        ``num_tiles`` / ``num_writes`` are the padded sizes (the real counts are only on the
        device).
    """
    p = get_preset(preset)
    g = p.group_size
    if not isinstance(staging_tiles, int) or staging_tiles < 1:
        raise ValueError(f"staging_tiles must be a positive int, got {staging_tiles!r}")
    if not isinstance(recent_tiles, int) or not 0 <= recent_tiles < staging_tiles:
        raise ValueError(
            f"recent_tiles must be an int in [0, staging_tiles={staging_tiles}), got "
            f"{recent_tiles!r}"
        )
    b = seq_lens.shape[0]
    for name, t, shape in (
        ("seq_lens", seq_lens, (b,)),
        ("query_start_loc", query_start_loc, (b + 1,)),
        ("num_drafts", num_drafts, (b,)),
        ("num_quantized", num_quantized, (b,)),
        ("staging_slots", staging_slots, (b,)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < b:
        raise ValueError(
            f"block_table must be [B={b}, max_blocks] ints, got shape {list(block_table.shape)}"
        )
    if exact_start is not None and tuple(exact_start.shape) != (b,):
        raise ValueError(f"exact_start must have shape [{b}], got {list(exact_start.shape)}")
    for name, n in (("max_tiles", max_tiles), ("max_writes", max_writes)):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if out is not None:
        _check_out(out, b, max_tiles, max_writes, window_keys)
    args = (seq_lens, query_start_loc, num_drafts, num_quantized, staging_slots, block_table, g)
    options: dict[str, Any] = {
        "staging_tiles": staging_tiles,
        "max_tiles": max_tiles,
        "max_writes": max_writes,
        "sink": sink,
        "recent_tiles": recent_tiles,
        "exact_start": exact_start,
        "window_keys": window_keys,
    }
    if _triton_planner(seq_lens):
        return _plan_store_device_triton(*args, **options, out=out)
    plan = _plan_store_device_torch(*args, **options)
    if out is None:
        return plan
    assert out.read_lens is not None
    for dst, src in (
        (out.tiles, plan.tiles),
        (out.writes, plan.writes),
        (out.seq_lens, plan.seq_lens),
        (out.quantized_lens, plan.quantized_lens),
        (out.read_lens, plan.attention_lens),
        (out.key_read_lens, plan.key_read_lens),
    ):
        if dst is not None and src is not None:
            dst.copy_(src)
    return _on(out, plan)


def _on(out: StorePlan, plan: StorePlan) -> StorePlan:
    """``plan`` with ``out``'s tensors (``read_lens`` only where the plan has one)."""
    return replace(
        plan,
        tiles=out.tiles,
        writes=out.writes,
        seq_lens=out.seq_lens,
        quantized_lens=out.quantized_lens,
        read_lens=None if plan.read_lens is None else out.read_lens,
        key_read_lens=out.key_read_lens,
    )


def _check_out(out: StorePlan, b: int, tiles: int, writes: int, window_keys: bool) -> None:
    """``out`` of :func:`plan_store_device` / :func:`plan_draft_device`: shapes and fields."""
    want = {
        "tiles": (tiles, 5),
        "writes": (writes, 4),
        "seq_lens": (b,),
        "quantized_lens": (b,),
        "read_lens": (b,),
        "key_read_lens": None if window_keys else (b,),
    }
    for name, shape in want.items():
        t = getattr(out, name)
        got = None if t is None else tuple(t.shape)
        if got != shape:
            raise ValueError(
                f"out.{name} must be "
                + ("None (window_keys=True)" if shape is None else f"int32 {list(shape)}")
                + f", got {'None' if got is None else list(got)}"
            )
        if t is not None and (t.dtype != torch.int32 or not t.is_contiguous()):
            raise ValueError(
                f"out.{name} must be a contiguous int32 tensor (the planners write it in "
                f"place), got {t.dtype}, strides {list(t.stride())}"
            )


def _triton_planner(seq_lens: torch.Tensor) -> bool:
    """The Triton planner runs where the kernels do (CUDA, or anywhere under the interpreter);
    ``KVARN_KERNELS_TORCH_PLANNER=1`` keeps the torch operations."""
    if settings.current().torch_planner:
        return False
    return seq_lens.device.type == "cuda" or INTERPRET


def _plan_store_device_torch(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_drafts: torch.Tensor,
    num_quantized: torch.Tensor,
    staging_slots: torch.Tensor,
    block_table: torch.Tensor,
    g: int,
    *,
    staging_tiles: int,
    max_tiles: int,
    max_writes: int,
    sink: bool,
    recent_tiles: int,
    exact_start: torch.Tensor | None,
    window_keys: bool,
) -> StorePlan:
    """:func:`plan_store_device` in torch operations (about 80 of them; the reference of the
    Triton planner, and the path for CPU tensors outside the interpreter)."""
    sg = staging_tiles * g
    b = seq_lens.shape[0]
    dev = seq_lens.device
    i64 = torch.int64
    qsl = query_start_loc.to(i64)
    total = seq_lens.to(i64)
    new = qsl[1:] - qsl[:-1]
    cached = total - new
    committed = total - num_drafts.to(i64).clamp(min=0)
    committed = torch.maximum(committed, cached)
    q_before = num_quantized.to(i64)
    q_after = torch.maximum(q_before, committed // g * g)
    slots = staging_slots.to(i64)
    max_blocks = block_table.shape[1]
    start_exact = cached // g * g if exact_start is None else exact_start.to(i64)
    read = window_start(cached, total, q_after, start_exact, g, recent_tiles, staging_tiles)
    key_tiles = staging_tiles - recent_tiles
    key_read = (
        read if window_keys else key_window_start(cached, total, q_after, start_exact, g, key_tiles)
    )

    # Tiles [q_before / G, q_after / G) of every request, flattened in request order.
    counts = (q_after - q_before) // g
    ends = torch.cumsum(counts, 0)
    j = torch.arange(max_tiles, dtype=i64, device=dev)
    owner = torch.searchsorted(ends, j, right=True).clamp(max=max(b - 1, 0))
    if b:
        tile_ok = j < ends[-1]
        t = q_before[owner] // g + j - (ends[owner] - counts[owner])
        start = t * g
        staged = (cached[owner] - start).clamp(0, g)
        fresh = torch.where(staged < g, qsl[owner] + start + staged - cached[owner], qsl[owner])
        col = t.clamp(0, max(max_blocks - 1, 0))
        block = block_table[owner, col].to(i64)
        tiles = torch.stack([block, slots[owner], start, staged, fresh], dim=1)
        tiles = torch.where(tile_ok[:, None], tiles, -1)
    else:
        tiles = torch.full((max_tiles, 5), -1, dtype=i64, device=dev)

    # Write row i = batch token i, kept when its position is past the quantized tiles.
    i = torch.arange(max_writes, dtype=i64, device=dev)
    if b:
        wowner = torch.searchsorted(qsl[1:], i, right=True).clamp(max=b - 1)
        pos = cached[wowner] + i - qsl[wowner]
        base = g if sink else 0
        value_kept = (pos >= read[wowner]) | (pos < base)
        write_ok = (i >= qsl[0]) & (i < qsl[-1]) & (value_kept | (pos >= key_read[wowner]))
        rows = torch.where(value_kept, staging_rows(pos, sg, base), -1)
        key_rows = _key_rows(pos, key_read[wowner], rows, key_tiles * g, window_keys)
        writes = torch.stack([i, slots[wowner], rows, key_rows], dim=1)
        writes = torch.where(write_ok[:, None], writes, -1)
    else:
        writes = torch.full((max_writes, 4), -1, dtype=i64, device=dev)
    return StorePlan(
        tiles=tiles.to(torch.int32).contiguous(),
        writes=writes.to(torch.int32).contiguous(),
        seq_lens=total.to(torch.int32),
        quantized_lens=q_after.to(torch.int32),
        num_tiles=max_tiles,
        num_writes=max_writes,
        group_size=g,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=recent_tiles,
        read_lens=read.to(torch.int32) if recent_tiles else None,
        window_keys=bool(window_keys),
        key_read_lens=None if window_keys else key_read.to(torch.int32),
    )


def _plan_store_device_triton(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_drafts: torch.Tensor,
    num_quantized: torch.Tensor,
    staging_slots: torch.Tensor,
    block_table: torch.Tensor,
    g: int,
    *,
    staging_tiles: int,
    max_tiles: int,
    max_writes: int,
    sink: bool,
    recent_tiles: int,
    exact_start: torch.Tensor | None,
    window_keys: bool,
    out: StorePlan | None = None,
) -> StorePlan:
    """:func:`plan_store_device` in two Triton launches (same outputs as the torch version)."""
    from kvarn_kernels._plan_triton import plan_entries_kernel, plan_rows_kernel

    b = seq_lens.shape[0]
    dev = seq_lens.device
    i32 = torch.int32
    if out is None:
        tiles = torch.empty((max_tiles, 5), dtype=i32, device=dev)
        writes = torch.empty((max_writes, 4), dtype=i32, device=dev)
        out_seq = torch.empty(b, dtype=i32, device=dev)
        out_quant = torch.empty(b, dtype=i32, device=dev)
        out_read = torch.empty(b, dtype=i32, device=dev) if recent_tiles else out_quant
        out_key = None if window_keys else torch.empty(b, dtype=i32, device=dev)
    else:
        assert out.read_lens is not None
        tiles, writes, out_seq, out_quant = out.tiles, out.writes, out.seq_lens, out.quantized_lens
        out_read, out_key = out.read_lens, out.key_read_lens
    if b == 0:
        tiles.fill_(-1)
        writes.fill_(-1)
    else:
        qsl = query_start_loc.contiguous()
        table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        scratch = torch.empty((6, b), dtype=torch.int64, device=dev)
        plan_rows_kernel[(1,)](
            seq_lens.contiguous(),
            qsl,
            num_drafts.contiguous(),
            num_quantized.contiguous(),
            seq_lens if exact_start is None else exact_start.contiguous(),
            b,
            scratch,
            out_seq,
            out_quant,
            out_read,
            out_quant if out_key is None else out_key,
            G=g,
            S=staging_tiles,
            RECENT=recent_tiles,
            WINDOW_KEYS=bool(window_keys),
            HAS_EXACT=exact_start is not None,
            BLOCK=_PLAN_BLOCK,
        )
        programs = triton.cdiv(max_tiles, _PLAN_BLOCK) + triton.cdiv(max_writes, _PLAN_BLOCK)
        if programs:
            plan_entries_kernel[(programs,)](
                qsl,
                staging_slots.contiguous(),
                table,
                table.stride(0),
                table.shape[1],
                b,
                b.bit_length(),
                scratch,
                tiles,
                writes,
                max_tiles,
                max_writes,
                G=g,
                SG=staging_tiles * g,
                SINK_ROWS=g if sink else 0,
                KEY_RING=(staging_tiles - recent_tiles) * g,
                WINDOW_KEYS=bool(window_keys),
                BLOCK=_PLAN_BLOCK,
            )
    return StorePlan(
        tiles=tiles,
        writes=writes,
        seq_lens=out_seq,
        quantized_lens=out_quant,
        num_tiles=max_tiles,
        num_writes=max_writes,
        group_size=g,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=recent_tiles,
        read_lens=out_read if recent_tiles else None,
        window_keys=bool(window_keys),
        key_read_lens=out_key,
    )


def plan_draft_device(
    seq_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    slot_quantized: torch.Tensor,
    slot_exact_start: torch.Tensor,
    preset: str | Preset,
    *,
    tokens_per_row: int,
    num_tokens: int,
    live_rows: int,
    staging_tiles: int,
    sink: bool = False,
    recent_tiles: int = 0,
    window_keys: bool = True,
    out: StorePlan | None = None,
) -> StorePlan:
    """A drafter step's store plan on the device: its tokens are drafts, so they go to staging
    and no tile is quantized (every tile row -1). No host synchronization, fixed shapes.

    Row ``b`` brings ``n = tokens_per_row`` tokens at its last positions
    ``seq_lens[b] - n .. seq_lens[b] - 1``; token ``t`` of the step belongs to row ``t // n``.
    Attention reads records up to ``min(slot_quantized[slot], first // G * G)`` (``first =
    seq_len - n``, the step's first position), the exact windows from there as
    :func:`window_start` / :func:`key_window_start` with ``exact_start`` taken from
    ``slot_exact_start[slot]``.

    Args:
        seq_lens: ``[B]`` int tokens of each row after the step.
        staging_slots: ``[B]`` int each row's staging slot.
        slot_quantized: int tokens in quantized tiles, indexed by staging slot (the target
            step's plan).
        slot_exact_start: int first position each slot's request wrote itself, by slot.
        preset: the cache preset (gives ``G``).
        tokens_per_row: ``n`` >= 1.
        num_tokens: write rows (the padded step's tokens); tokens past ``live_rows * n`` and
            positions below 0 write nothing (-1).
        live_rows: rows with real tokens (the rest are padding of a CUDA graph).
        staging_tiles: as :func:`plan_store_device`.
        sink: as :func:`plan_store_device`.
        recent_tiles: as :func:`plan_store_device`.
        window_keys: as :func:`plan_store_device`.
        out: a plan whose tensors (``tiles`` ``[B, 5]``, ``writes`` ``[num_tokens, 4]``,
            ``seq_lens``, ``quantized_lens``, ``read_lens`` and, with ``window_keys=False``,
            ``key_read_lens``) are written in place, e.g. views of a CUDA graph's buffers;
            ``None`` allocates them.

    Returns:
        The plan (on ``out``'s tensors when given, with this call's settings), ``read_lens``
        always set.
    """
    p = get_preset(preset)
    g = p.group_size
    b = seq_lens.shape[0]
    if not isinstance(tokens_per_row, int) or tokens_per_row < 1:
        raise ValueError(f"tokens_per_row must be an int >= 1, got {tokens_per_row!r}")
    if not isinstance(recent_tiles, int) or not 0 <= recent_tiles < staging_tiles:
        raise ValueError(
            f"recent_tiles must be an int in [0, staging_tiles={staging_tiles}), got "
            f"{recent_tiles!r}"
        )
    if tuple(staging_slots.shape) != (b,):
        raise ValueError(f"staging_slots must have shape [{b}], got {list(staging_slots.shape)}")
    dev = seq_lens.device
    i32 = torch.int32
    if out is None:
        out = StorePlan(
            tiles=torch.empty((b, 5), dtype=i32, device=dev),
            writes=torch.empty((num_tokens, 4), dtype=i32, device=dev),
            seq_lens=torch.empty(b, dtype=i32, device=dev),
            quantized_lens=torch.empty(b, dtype=i32, device=dev),
            num_tiles=b,
            num_writes=num_tokens,
            group_size=g,
            staging_tiles=staging_tiles,
            sink=sink,
            recent_tiles=recent_tiles,
            read_lens=torch.empty(b, dtype=i32, device=dev),
            window_keys=bool(window_keys),
            key_read_lens=None if window_keys else torch.empty(b, dtype=i32, device=dev),
        )
    _check_out(out, b, b, num_tokens, window_keys)
    key_tiles = 0 if window_keys else staging_tiles - recent_tiles
    run = _plan_draft_triton if _triton_planner(seq_lens) else _plan_draft_torch
    run(
        seq_lens.contiguous(),
        staging_slots.contiguous(),
        slot_quantized.contiguous(),
        slot_exact_start.contiguous(),
        out,
        g=g,
        n=tokens_per_row,
        num_tokens=num_tokens,
        live_rows=live_rows,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=recent_tiles,
        key_tiles=key_tiles,
    )
    # The plan's settings are this call's, whatever ``out`` carried (as plan_store_device).
    return replace(
        out,
        num_tiles=b,
        num_writes=num_tokens,
        group_size=g,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=recent_tiles,
        window_keys=bool(window_keys),
    )


def _plan_draft_triton(
    seq_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    slot_quantized: torch.Tensor,
    slot_exact_start: torch.Tensor,
    out: StorePlan,
    *,
    g: int,
    n: int,
    num_tokens: int,
    live_rows: int,
    staging_tiles: int,
    sink: bool,
    recent_tiles: int,
    key_tiles: int,
) -> None:
    """:func:`plan_draft_device` in one Triton launch, into ``out``."""
    from kvarn_kernels._plan_triton import plan_draft_kernel

    b = seq_lens.shape[0]
    programs = triton.cdiv(b, _PLAN_BLOCK) + triton.cdiv(num_tokens, _PLAN_BLOCK)
    if not programs:
        return
    assert out.read_lens is not None
    plan_draft_kernel[(programs,)](
        seq_lens,
        staging_slots,
        slot_quantized,
        slot_exact_start,
        b,
        n,
        num_tokens,
        live_rows,
        out.tiles,
        out.writes,
        out.seq_lens,
        out.quantized_lens,
        out.read_lens,
        out.read_lens if out.key_read_lens is None else out.key_read_lens,
        G=g,
        S=staging_tiles,
        SINK_ROWS=g if sink else 0,
        RECENT=recent_tiles,
        KEY_TILES=key_tiles,
        BLOCK=_PLAN_BLOCK,
    )


def _plan_draft_torch(
    seq_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    slot_quantized: torch.Tensor,
    slot_exact_start: torch.Tensor,
    out: StorePlan,
    *,
    g: int,
    n: int,
    num_tokens: int,
    live_rows: int,
    staging_tiles: int,
    sink: bool,
    recent_tiles: int,
    key_tiles: int,
) -> None:
    """:func:`plan_draft_device` in torch operations, into ``out`` (the Triton kernel's
    tested twin; about 35 operations)."""
    assert out.read_lens is not None
    i32 = torch.int32
    b = seq_lens.shape[0]
    seq = seq_lens.to(i32)
    slots = staging_slots.long()
    first = (seq - n).clamp(min=0)
    quant = torch.minimum(slot_quantized[slots], first // g * g)
    start = slot_exact_start[slots]
    out.seq_lens.copy_(seq)
    out.quantized_lens.copy_(quant)
    out.read_lens.copy_(window_start(first, seq, quant, start, g, recent_tiles, staging_tiles))
    if out.key_read_lens is not None:
        out.key_read_lens.copy_(key_window_start(first, seq, quant, start, g, key_tiles))
    tokens = torch.arange(num_tokens, dtype=i32, device=seq.device)
    owner = tokens // n  # past the real rows for a graph's padding tokens
    rows = owner.clamp(max=max(b - 1, 0)).long()
    pos = seq.index_select(0, rows) - n + tokens % n
    value_rows = staging_rows(pos.clamp(min=0), staging_tiles * g, g if sink else 0)
    key_rows = value_rows if not key_tiles else pos.clamp(min=0) % (key_tiles * g)
    ok = (owner < live_rows) & (pos >= 0)
    row_slots = staging_slots.index_select(0, rows).to(i32)
    writes = torch.stack([tokens, row_slots, value_rows, key_rows], 1)
    out.tiles.fill_(-1)
    out.writes.copy_(torch.where(ok[:, None], writes, -1))
