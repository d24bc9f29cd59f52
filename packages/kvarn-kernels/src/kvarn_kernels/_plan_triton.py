"""Triton twin of :func:`kvarn_kernels.plan_store_device`: the whole plan in two launches.

The torch version takes about 80 small operations, each a kernel launch and a trip through the
dispatcher; under speculative decoding it runs once per target step and once per drafter step,
on the host's critical path. Here one program walks the rows (lengths, commit, windows and the
running sum of the tiles to quantize), and a second launch fills the tile and write rows, each
finding its request by binary search. Same inputs, same outputs, bit for bit (tested against
the torch version). Integer divisions only ever see non-negative operands, so Triton's
truncating division and NumPy's floor division (the interpreter) agree.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import staging_rows

__all__ = ["plan_entries_kernel", "plan_rows_kernel"]

# Batch sizes and buffer views change from step to step: one compiled variant per engine
# configuration, none during serving (no specialization on value or alignment).
_ROW_INTS = ("b",)
_ROW_PTRS = (
    "seq_ptr",
    "qsl_ptr",
    "drafts_ptr",
    "quant_ptr",
    "exact_ptr",
    "scratch_ptr",
    "out_seq_ptr",
    "out_quant_ptr",
    "out_read_ptr",
    "out_key_read_ptr",
)
_ENTRY_INTS = ("table_stride", "max_blocks", "b", "steps", "max_tiles", "max_writes")
_ENTRY_PTRS = ("qsl_ptr", "slots_ptr", "table_ptr", "scratch_ptr", "tiles_ptr", "writes_ptr")


@triton.jit(do_not_specialize=_ROW_INTS, do_not_specialize_on_alignment=_ROW_PTRS)
def plan_rows_kernel(
    seq_ptr,
    qsl_ptr,
    drafts_ptr,
    quant_ptr,
    exact_ptr,
    b,
    scratch_ptr,  # int64 [6, b]: cached, q_before, counts, ends, read, key_read
    out_seq_ptr,
    out_quant_ptr,
    out_read_ptr,
    out_key_read_ptr,
    G: tl.constexpr,
    S: tl.constexpr,
    RECENT: tl.constexpr,
    WINDOW_KEYS: tl.constexpr,
    HAS_EXACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: per-row lengths and the running sum of tiles to quantize (``ends``)."""
    carry = tl.zeros([], dtype=tl.int64)
    for first in range(0, b, BLOCK):
        r = first + tl.arange(0, BLOCK)
        ok = r < b
        total = tl.load(seq_ptr + r, mask=ok, other=0).to(tl.int64)
        q0 = tl.load(qsl_ptr + r, mask=ok, other=0).to(tl.int64)
        q1 = tl.load(qsl_ptr + r + 1, mask=ok, other=0).to(tl.int64)
        drafts = tl.maximum(tl.load(drafts_ptr + r, mask=ok, other=0).to(tl.int64), 0)
        q_before = tl.load(quant_ptr + r, mask=ok, other=0).to(tl.int64)
        cached = total - (q1 - q0)
        committed = tl.maximum(total - drafts, cached)
        q_after = tl.maximum(q_before, tl.maximum(committed, 0) // G * G)
        if HAS_EXACT:
            start_exact = tl.load(exact_ptr + r, mask=ok, other=0).to(tl.int64)
        else:
            start_exact = tl.maximum(cached, 0) // G * G
        # ceil((total - S*G) / G) * G with non-negative division only
        over = total - S * G
        ring = tl.where(over > 0, (over + G - 1) // G * G, -((-over) // G * G))
        if RECENT > 0:
            window = (tl.maximum(cached, 0) // G - RECENT) * G
            read = tl.minimum(q_after, tl.maximum(tl.maximum(start_exact, window), ring))
        else:
            read = q_after
        if WINDOW_KEYS:
            key_read = read
        else:
            over_k = total - (S - RECENT) * G
            ring_k = tl.where(over_k > 0, (over_k + G - 1) // G * G, -((-over_k) // G * G))
            own = tl.maximum(cached, 0) // G * G
            key_read = tl.minimum(q_after, tl.maximum(tl.maximum(start_exact, own), ring_k))
            tl.store(out_key_read_ptr + r, key_read.to(tl.int32), mask=ok)
        counts = tl.where(ok, (q_after - q_before) // G, 0)
        ends = tl.cumsum(counts, 0) + carry
        carry += tl.sum(counts, 0)
        tl.store(scratch_ptr + r, cached, mask=ok)
        tl.store(scratch_ptr + b + r, q_before, mask=ok)
        tl.store(scratch_ptr + 2 * b + r, counts, mask=ok)
        tl.store(scratch_ptr + 3 * b + r, ends, mask=ok)
        tl.store(scratch_ptr + 4 * b + r, read, mask=ok)
        tl.store(scratch_ptr + 5 * b + r, key_read, mask=ok)
        tl.store(out_seq_ptr + r, total.to(tl.int32), mask=ok)
        tl.store(out_quant_ptr + r, q_after.to(tl.int32), mask=ok)
        tl.store(out_read_ptr + r, read.to(tl.int32), mask=ok)  # = q_after without RECENT


@triton.jit
def _owner(sorted_ptr, b, x, steps):
    """``min(searchsorted(sorted[:b], x, right=True), b - 1)`` for each element of ``x``."""
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + b
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = lo < hi
        v = tl.load(sorted_ptr + tl.minimum(mid, b - 1), mask=go, other=0)
        right = go & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & (v > x), mid, hi)
    return tl.minimum(lo, b - 1)


@triton.jit(do_not_specialize=_ENTRY_INTS, do_not_specialize_on_alignment=_ENTRY_PTRS)
def plan_entries_kernel(
    qsl_ptr,
    slots_ptr,
    table_ptr,
    table_stride,
    max_blocks,
    b,
    steps,
    scratch_ptr,
    tiles_ptr,
    writes_ptr,
    max_tiles,
    max_writes,
    G: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    KEY_RING: tl.constexpr,
    WINDOW_KEYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Programs ``[0, cdiv(max_tiles, BLOCK))`` fill tile rows, the rest write rows."""
    pid = tl.program_id(0)
    tile_programs = tl.cdiv(max_tiles, BLOCK)
    cols = tl.arange(0, 8)
    if pid < tile_programs:
        j = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        in_range = j < max_tiles
        ends_ptr = scratch_ptr + 3 * b
        owner = _owner(ends_ptr, b, j, steps)
        total_tiles = tl.load(ends_ptr + b - 1)
        tile_ok = in_range & (j < total_tiles)
        counts = tl.load(scratch_ptr + 2 * b + owner)
        ends = tl.load(ends_ptr + owner)
        cached = tl.load(scratch_ptr + owner)
        q_before = tl.load(scratch_ptr + b + owner)
        q0 = tl.load(qsl_ptr + owner).to(tl.int64)
        t = q_before // G + j - (ends - counts)
        start = t * G
        staged = tl.minimum(tl.maximum(cached - start, 0), G)
        fresh = tl.where(staged < G, q0 + start + staged - cached, q0)
        col = tl.minimum(tl.maximum(t, 0), tl.maximum(max_blocks - 1, 0))
        block = tl.load(table_ptr + owner * table_stride + col, mask=tile_ok, other=-1)
        slot = tl.load(slots_ptr + owner).to(tl.int64)
        c = cols[None, :]
        row = tl.where(
            c == 0,
            block.to(tl.int64)[:, None],
            tl.where(
                c == 1,
                slot[:, None],
                tl.where(c == 2, start[:, None], tl.where(c == 3, staged[:, None], fresh[:, None])),
            ),
        )
        row = tl.where(tile_ok[:, None], row, -1)
        tl.store(tiles_ptr + j[:, None] * 5 + c, row.to(tl.int32), mask=in_range[:, None] & (c < 5))
    else:
        i = (pid - tile_programs) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        in_range = i < max_writes
        w = _owner(qsl_ptr + 1, b, i, steps)
        first = tl.load(qsl_ptr).to(tl.int64)
        last = tl.load(qsl_ptr + b).to(tl.int64)
        cached = tl.load(scratch_ptr + w)
        read = tl.load(scratch_ptr + 4 * b + w)
        key_read = tl.load(scratch_ptr + 5 * b + w)
        q0 = tl.load(qsl_ptr + w).to(tl.int64)
        pos = cached + i - q0
        value_kept = (pos >= read) | (pos < SINK_ROWS)
        write_ok = in_range & (i >= first) & (i < last) & (value_kept | (pos >= key_read))
        rows = tl.where(value_kept, staging_rows(pos, SG, SINK_ROWS), -1)
        if WINDOW_KEYS:
            key_rows = rows
        else:
            key_rows = tl.where(pos >= key_read, tl.maximum(pos, 0) % KEY_RING, -1)
        slot = tl.load(slots_ptr + w).to(tl.int64)
        c = cols[None, :]
        row = tl.where(
            c == 0,
            i[:, None],
            tl.where(c == 1, slot[:, None], tl.where(c == 2, rows[:, None], key_rows[:, None])),
        )
        row = tl.where(write_ok[:, None], row, -1)
        tl.store(
            writes_ptr + i[:, None] * 4 + c, row.to(tl.int32), mask=in_range[:, None] & (c < 4)
        )


_DRAFT_INTS = ("b", "n", "num_tokens", "live")
_DRAFT_PTRS = (
    "seq_ptr",
    "slots_ptr",
    "slot_quant_ptr",
    "slot_start_ptr",
    "tiles_ptr",
    "writes_ptr",
    "out_seq_ptr",
    "out_quant_ptr",
    "out_read_ptr",
    "out_key_read_ptr",
)


@triton.jit(do_not_specialize=_DRAFT_INTS, do_not_specialize_on_alignment=_DRAFT_PTRS)
def plan_draft_kernel(
    seq_ptr,
    slots_ptr,
    slot_quant_ptr,
    slot_start_ptr,
    b,
    n,
    num_tokens,
    live,
    tiles_ptr,
    writes_ptr,
    out_seq_ptr,
    out_quant_ptr,
    out_read_ptr,
    out_key_read_ptr,
    G: tl.constexpr,
    S: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    RECENT: tl.constexpr,
    KEY_TILES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A drafter step's plan (see ``plan_draft_device``): programs ``[0, cdiv(b, BLOCK))`` do
    rows ``r`` (lengths, windows, an empty tile row), the rest token write rows ``t``."""
    pid = tl.program_id(0)
    row_programs = tl.cdiv(b, BLOCK)
    if pid < row_programs:
        r = pid * BLOCK + tl.arange(0, BLOCK)
        ok = r < b
        seq = tl.load(seq_ptr + r, mask=ok, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + r, mask=ok, other=0).to(tl.int64)
        first = tl.maximum(seq - n, 0)
        quant = tl.minimum(
            tl.load(slot_quant_ptr + slot, mask=ok, other=0).to(tl.int64), first // G * G
        )
        start = tl.load(slot_start_ptr + slot, mask=ok, other=0).to(tl.int64)
        over = seq - S * G
        ring = tl.where(over > 0, (over + G - 1) // G * G, -((-over) // G * G))
        if RECENT > 0:
            window = (first // G - RECENT) * G
            read = tl.minimum(quant, tl.maximum(tl.maximum(start, window), ring))
        else:
            read = quant
        if KEY_TILES > 0:
            over_k = seq - KEY_TILES * G
            ring_k = tl.where(over_k > 0, (over_k + G - 1) // G * G, -((-over_k) // G * G))
            key_read = tl.minimum(quant, tl.maximum(tl.maximum(start, first // G * G), ring_k))
            tl.store(out_key_read_ptr + r, key_read.to(tl.int32), mask=ok)
        tl.store(out_seq_ptr + r, seq.to(tl.int32), mask=ok)
        tl.store(out_quant_ptr + r, quant.to(tl.int32), mask=ok)
        tl.store(out_read_ptr + r, read.to(tl.int32), mask=ok)
        c5 = tl.arange(0, 8)[None, :]
        tl.store(
            tiles_ptr + r[:, None] * 5 + c5,
            tl.full([BLOCK, 8], -1, tl.int32),
            mask=ok[:, None] & (c5 < 5),
        )
    else:
        t = (pid - row_programs) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        in_range = t < num_tokens
        owner = t // n
        row = tl.minimum(owner, tl.maximum(b - 1, 0))
        seq = tl.load(seq_ptr + row, mask=in_range & (b > 0), other=0).to(tl.int64)
        pos = seq - n + t % n
        at = tl.maximum(pos, 0)
        value_rows = staging_rows(at, S * G, SINK_ROWS)
        if KEY_TILES > 0:
            key_rows = at % (KEY_TILES * G)
        else:
            key_rows = value_rows
        write_ok = in_range & (owner < live) & (pos >= 0)
        slot = tl.load(slots_ptr + row, mask=in_range & (b > 0), other=0).to(tl.int64)
        c = tl.arange(0, 4)[None, :]
        entry = tl.where(
            c == 0,
            t[:, None],
            tl.where(
                c == 1, slot[:, None], tl.where(c == 2, value_rows[:, None], key_rows[:, None])
            ),
        )
        entry = tl.where(write_ok[:, None], entry, -1)
        tl.store(writes_ptr + t[:, None] * 4 + c, entry.to(tl.int32), mask=in_range[:, None])
