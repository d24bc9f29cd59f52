"""The exact first tile (the attention sink): which staging slot's sink rows each request
reads its tile 0 from.

A request that computes its first tile keeps an exact copy of it in its slot's sink rows
(besides the quantized record); one that hits the prefix cache on tile 0 reads the rows of
the slot that holds the same first tile (the same block ids), for as long as they hold it.
The table is per process, shared by every builder of a worker, and updated once per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvarn_vllm.step import StepRecord

__all__ = ["reset", "sink_rows_for"]

# Per-process host state of the exact first tile, shared by every builder of the process,
# per request-state row (= staging slot):
#   "owner": the first-tile key (block ids of tile 0, per KV cache group) whose exact copy the
#            slot's sink rows hold, or None. Set when a request that computes its own tile 0
#            is added to the slot; those rows are overwritten only by the next such request.
#   "src":   the slot whose sink rows the slot's current request reads its tile 0 from, or -1
#            (it reads the quantized record). A request that computed tile 0 reads its own; one
#            that hit the prefix cache there reads the rows of the slot that holds the same
#            key, while they hold it.
_SINK_STATE: dict[str, Any] = {}


def _sink_tables(rows: int) -> tuple[list[Any], dict[Any, int], np.ndarray]:
    owner = _SINK_STATE.get("owner")
    if owner is None or len(owner) < rows:
        owner = [None] * rows
        _SINK_STATE["owner"] = owner
        _SINK_STATE["claims"] = {}  # key -> the one slot whose sink rows hold it
        _SINK_STATE["src"] = np.full(rows, -1, dtype=np.int32)
        _SINK_STATE["serial"] = -1
    return owner, _SINK_STATE["claims"], _SINK_STATE["src"]


def sink_rows_for(
    record: StepRecord, slots: np.ndarray, num_cached: np.ndarray, group_size: int, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(sink_lens, sink_slots)`` of a step, each ``[len(slots)]`` int32.

    ``sink_lens[b]`` is ``G`` where row b's request reads its first tile exact from the sink
    rows of staging slot ``sink_slots[b]``, else 0 (it reads tile 0's quantized record).

    A request (re)added to a row this step with ``num_cached < G`` computes its first tile
    and writes it to its own sink rows. One added with ``num_cached >= G`` hit the prefix
    cache on tile 0: it reads the sink rows of a slot whose rows hold the same first tile
    (the same block ids), written by the request that computed it, for as long as they hold
    it; when another request overwrites them, it falls back to the quantized record. Without
    ``record.first_blocks`` (unknown block ids) a hit reads the quantized record.
    """
    owner, claims, src = _sink_tables(rows)
    real = min(record.num_reqs, slots.shape[0])
    if _SINK_STATE["serial"] != record.serial and record.new_rows is not None:
        new = np.asarray(record.new_rows[:real], dtype=bool)
        keys = record.first_blocks or {}
        added = [(int(slots[b]), int(num_cached[b])) for b in range(real) if new[b]]
        # Requests that compute tile 0 first: a hit in the same step reads what they write
        # (each layer stores before it attends).
        for slot, cached in sorted(added, key=lambda a: a[1] >= group_size):
            key = keys.get(slot)
            if cached < group_size:
                # This slot's sink rows get the new request's tile 0: readers of the old
                # content fall back to the quantized record, and its old key is no longer
                # held anywhere.
                src[(src == slot) & (np.arange(src.shape[0]) != slot)] = -1
                if owner[slot] is not None and claims.get(owner[slot]) == slot:
                    del claims[owner[slot]]
                if key is not None:
                    # The same block ids computed again: their content was replaced, so an
                    # older copy elsewhere is stale.
                    stale = claims.get(key)
                    if stale is not None:
                        owner[stale] = None
                    claims[key] = slot
                owner[slot] = key
                src[slot] = slot
            else:
                src[slot] = -1 if key is None else claims.get(key, -1)
        _SINK_STATE["serial"] = record.serial
    lens = np.zeros(slots.shape[0], dtype=np.int32)
    sink_slots = np.asarray(slots, dtype=np.int32).copy()
    got = src[slots[:real]]
    lens[:real] = np.where(got >= 0, group_size, 0)
    sink_slots[:real] = np.where(got >= 0, got, slots[:real])
    return lens, sink_slots


def reset() -> None:
    """Forget every slot's first tile (a fresh worker's state; tests start from it)."""
    _SINK_STATE.clear()
