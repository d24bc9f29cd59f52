"""What the model runner reports for each step, handed to the metadata builders.

The runner hooks of the patch ledger (:mod:`kvarn_vllm.patches`) report each step here
before vLLM builds its attention metadata: the V2 runner's request-state rows
(``InputBatch.idx_mapping``), or on the V1 runner, which has no such rows, the step's request
ids, for which :data:`STEP` keeps staging slots itself; drafts per row; which rows were
(re)added; and whether a build is a drafter's step (EAGLE, MTP) or inside a DFlash proposal.
The builders read :attr:`STEP.record <_StepChannel.record>` once per step.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvarn_vllm.compat import first_tile_blocks

__all__ = ["STEP", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """What the model runner reported for the step being prepared.

    Attributes:
        serial: increases by one per report.
        num_reqs: real (unpadded) requests in the batch.
        slots: ``[num_reqs]`` int32, request-state row of each batch row (staging slot);
            None for a dummy (profiling, warm-up, capture) batch.
        num_drafts: ``[num_reqs]`` int32 speculative drafts scheduled per row (the row's
            last tokens; 0 without speculation), or None.
        new_rows: ``[num_reqs]`` bool, the row's request was (re)added to its request-state
            row this step (new, or resumed after preemption), or None.
        first_blocks: for rows (re)added this step, the block ids of their first tile (one
            per KV cache group) from the scheduler's request data, or None when unknown: the
            identity of tile 0's content, which prefix caching shares between requests.
    """

    serial: int
    num_reqs: int
    slots: np.ndarray | None
    num_drafts: np.ndarray | None = None
    new_rows: np.ndarray | None = None
    first_blocks: dict[int, tuple[int, ...] | None] | None = None


class _StepChannel:
    """Hand-off from the runner hook to the builders of one worker process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record = StepRecord(serial=0, num_reqs=0, slots=None)
        self._added: dict[int, tuple[int, ...] | None] = {}
        self._local = threading.local()  # per thread: draft-step depth, DFlash target metadata
        # V1 model runner: staging slots by request id (see report_v1_schedule).
        self._v1_runner: Any = None
        self._v1_slots: dict[str, int] = {}
        self._v1_free: list[int] = []  # released slots (a heap), all below _v1_next
        self._v1_next = 0
        self._v1_drafts: dict[str, int] = {}

    def report_added(self, rows: Any, first_blocks: Any = None) -> None:
        """Request-state rows (re)assigned to a request in this step (before report_real),
        with the block ids of each one's first tile (per KV cache group) where known."""
        with self._lock:
            for i, r in enumerate(rows):
                key = None if first_blocks is None else first_blocks[i]
                self._added[int(r)] = None if key is None else tuple(int(b) for b in key)

    def report_real(self, input_batch: Any) -> None:
        """A scheduled step of the V2 model runner: its ``InputBatch`` (request-state rows,
        drafts per row)."""
        num_reqs = int(input_batch.num_reqs)
        slots = np.asarray(input_batch.idx_mapping_np[:num_reqs], dtype=np.int32).copy()
        drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
        num_drafts = np.zeros(num_reqs, dtype=np.int32)
        if drafts is not None:
            num_drafts[:] = np.asarray(drafts, dtype=np.int32)[:num_reqs]
        self._publish(slots, num_drafts)

    def report_v1_schedule(self, runner: Any, scheduler_output: Any) -> None:
        """A step's ``SchedulerOutput`` on the V1 model runner, before its batch is laid out.

        The V1 runner has no request-stable rows, so staging slots are kept here by request
        id: a finished or preempted request releases its slot; a new request, or one resumed
        after preemption (it recomputes its tokens), takes the lowest free slot and counts as
        added (:meth:`report_added`). A request merely left out of a step keeps its slot.
        Live requests never exceed ``max_num_seqs``, so neither do the slots. A different
        runner object (a new engine in this process) starts from no slots.
        """
        new = list(scheduler_output.scheduled_new_reqs)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        added = [(r.req_id, first_tile_blocks(getattr(r, "block_ids", None))) for r in new]
        for i, req_id in enumerate(cached.req_ids):
            if req_id in resumed:
                added.append((req_id, first_tile_blocks(cached.new_block_ids[i])))
        gone = set(scheduler_output.finished_req_ids or ())
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= {req_id for req_id, _ in added}
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        with self._lock:
            if self._v1_runner is None or self._v1_runner() is not runner:
                self._v1_runner = weakref.ref(runner)
                self._v1_slots.clear()
                self._v1_free.clear()
                self._v1_next = 0
            for req_id in gone:
                slot = self._v1_slots.pop(req_id, None)
                if slot is not None:
                    heapq.heappush(self._v1_free, slot)
            for req_id, blocks in added:
                if self._v1_free:
                    slot = heapq.heappop(self._v1_free)
                else:
                    slot, self._v1_next = self._v1_next, self._v1_next + 1
                self._v1_slots[req_id] = slot
                self._added[slot] = blocks
            self._v1_drafts = {req_id: len(tokens) for req_id, tokens in spec.items()}

    def report_v1_batch(self, runner: Any, req_ids: list[str]) -> None:
        """A scheduled step's batch on the V1 model runner: its rows' request ids, in order."""
        with self._lock:
            missing = [r for r in req_ids if r not in self._v1_slots]
            if missing or self._v1_runner is None or self._v1_runner() is not runner:
                raise RuntimeError(
                    f"kvarn: requests {missing[:3]} are in the V1 model runner's batch without "
                    "a staging slot (their scheduling was not reported to kvarn). This is a "
                    "kvarn-vllm bug; please report it with your vLLM version."
                )
            slots = np.array([self._v1_slots[r] for r in req_ids], dtype=np.int32)
            num_drafts = np.array([self._v1_drafts.get(r, 0) for r in req_ids], dtype=np.int32)
        self._publish(slots, num_drafts)

    def report_dummy_rows(self, num_reqs: int) -> None:
        """A profiling, warm-up or capture batch of ``num_reqs`` rows (either runner)."""
        with self._lock:
            self._record = StepRecord(self._record.serial + 1, int(num_reqs), None)

    def _publish(self, slots: np.ndarray, num_drafts: np.ndarray) -> None:
        num_reqs = len(slots)
        with self._lock:
            new_rows = np.isin(slots, np.fromiter(self._added, dtype=np.int32))
            first_blocks = dict(self._added)
            self._added.clear()
            self._record = StepRecord(
                self._record.serial + 1, num_reqs, slots, num_drafts, new_rows, first_blocks
            )

    def draft_steps(self) -> Any:
        """Context manager: metadata built inside it is for a drafter's decode step."""
        return _DraftStepScope(self)

    @property
    def in_draft_step(self) -> int:
        return getattr(self._local, "value", 0)

    def proposing(self, attn_metadata: Any) -> Any:
        """Context manager around a DFlash proposal: ``attn_metadata`` (the target step's
        metadata by layer name, draft layers included) is :attr:`target_metadata` inside it,
        for the drafter's context store (``KvarnAttentionImpl.do_kv_cache_update``)."""
        return _ProposingScope(self, attn_metadata)

    @property
    def target_metadata(self) -> Any:
        """The target step's metadata by layer name inside :meth:`proposing`, else None."""
        return getattr(self._local, "target", None)

    def report_dummy(self, input_batch: Any) -> None:
        """A profiling, warm-up or capture batch of the V2 runner: its ``InputBatch``."""
        self.report_dummy_rows(int(input_batch.num_reqs))

    @property
    def record(self) -> StepRecord:
        with self._lock:
            return self._record


class _DraftStepScope:
    """:meth:`_StepChannel.draft_steps`: one level deeper in a drafter's step while inside."""

    def __init__(self, channel: _StepChannel) -> None:
        self._channel = channel

    def __enter__(self) -> None:
        self._channel._local.value = self._channel.in_draft_step + 1

    def __exit__(self, *exc: object) -> None:
        self._channel._local.value = self._channel.in_draft_step - 1


class _ProposingScope:
    """:meth:`_StepChannel.proposing`: the target step's metadata by layer name inside."""

    def __init__(self, channel: _StepChannel, attn_metadata: Any) -> None:
        self._channel = channel
        self._attn_metadata = attn_metadata

    def __enter__(self) -> None:
        self._channel._local.target = self._attn_metadata

    def __exit__(self, *exc: object) -> None:
        self._channel._local.target = None


STEP = _StepChannel()
"""The step channel of this process (every builder of a worker reads it)."""
