"""Per-step planning: the metadata builder (once per step and KV cache group, not per layer).

Each step the builder

1. takes every request's staging slot from the V2 model runner's request-state row
   (``InputBatch.idx_mapping``: fixed for a request's life, reused after it finishes or
   is preempted; see :mod:`kvarn_vllm.patches`), or on the V1 runner, which has no such
   row, from :data:`STEP`'s own slots by request id; either way a slot is never shared by
   two live requests;
2. calls ``kvarn_kernels.plan_store`` once (host NumPy) for the whole batch;
3. splits the rows into three kinds, each served by one attention call per layer:

   * ``decode``: one new token after cached ones -> ``decode_attention`` over the cache;
     in a mixed speculative step also the query tokens of its verify blocks, one decode row
     each (:attr:`RowGroup.per_token`);
   * ``fresh``: a prompt's first chunk with nothing cached -> exact causal attention over
     the fresh K/V (vLLM's Triton varlen kernel), as the published fork does;
   * ``context``: a chunk after cached tokens (chunked prefill continuation, prefix-cache
     hit, the verify blocks of a uniform speculative step) -> ``multi_query_attention`` over
     the cache, after this step's store, or a dense path (:mod:`kvarn_vllm.impl`), or the
     verify blocks as decode rows;

4. copies everything the kernels read into persistent device buffers with one host to
   device copy, so full CUDA graphs of uniform decode batches replay with fresh values.

The block ids of the tiles to quantize are resolved on the device: ``plan_store`` sees a
host table of *encoded* positions ``row * max_blocks + tile`` (vLLM 0.26 keeps block
tables on the GPU only), and the builder gathers the real ids from the device block
table. Nothing here synchronizes with the GPU.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvarn_vllm.config import KvarnConfig, env_flag, parse_kv_cache_dtype

__all__ = [
    "SPEC_METHODS",
    "STEP",
    "BatchSplit",
    "KvarnMetadata",
    "KvarnMetadataBuilder",  # noqa: F822 (built lazily, see __getattr__)
    "StepRecord",
    "encoded_block_table",
    "split_rows",
    "warm_kernels",
]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

SPEC_METHODS = {"v2": ("eagle", "eagle3", "mtp", "dflash"), "v1": ("ngram", "ngram_gpu")}
"""Speculative methods served, by vLLM 0.26 model runner: V2 drafts EAGLE, EAGLE-3 and MTP one
token per step (each draft step marked by :data:`STEP`), DFlash a non-causal block of ``1 + k``
tokens per step (its context K/V stored with the target step's plan, :meth:`STEP.proposing
<_StepChannel.proposing>`); V1 runs n-gram (prompt lookup), whose
drafts are only verified on the GPU: ``ngram`` proposes them on the host (vLLM then schedules
synchronously), ``ngram_gpu`` on the GPU under async scheduling (the host's lengths are upper
bounds, and the step's plan is made on the device as for EAGLE)."""

WARMUP_ENV = "KVARN_VLLM_WARMUP"
_WARMED: set[tuple[Any, ...]] = set()


def warm_kernels(config: KvarnConfig, kv_cache_spec: Any, vllm_config: Any, device: Any) -> Any:
    """Compile the kernels' variants for this KV cache group before vLLM serves.

    vLLM's own warm-up runs 2-token prompts and decodes, so the multi-query kernel, the
    dense-context path and the tile store would otherwise compile inside the first long
    requests (about 11 s of a 12 x 16K burst on an H200, 2026-11-30). Once per process and
    shape; GPU only; ``KVARN_VLLM_WARMUP=0`` skips it. Returns ``kvarn_kernels.warmup``'s
    summary, or ``None`` when skipped.
    """
    if not env_flag(WARMUP_ENV, True) or getattr(device, "type", "cpu") != "cuda":
        return None
    from kvarn_vllm import kernels
    from kvarn_vllm.impl import staging_report

    model = vllm_config.model_config
    num_q_heads = int(model.get_num_attention_heads(vllm_config.parallel_config))
    window = getattr(kv_cache_spec, "sliding_window", None)
    # The multi-query variants the layers launch (impl's forward): with the step's own K/V,
    # without it in batch-invariant mode and for layers that share another's KV cache.
    if config.batch_invariant:
        own_kv: tuple[bool, ...] = (False,)
    else:
        own_kv = (False, True) if staging_report()["shared_layers"] else (True,)
    key = (
        str(device),
        config.preset.name,
        int(kv_cache_spec.head_size),
        num_q_heads,
        int(kv_cache_spec.num_kv_heads),
        model.dtype,
        config.ring_tiles,
        config.sink,
        config.batch_invariant,
        window,
        own_kv,
        config.key_frame,
        config.key_tiles,
        config.frame_queries,
    )
    if key in _WARMED:
        return None
    _WARMED.add(key)
    from kvarn_vllm.plugin import kernel_cache_dir

    # One Triton cache folder for every engine configuration (vLLM gives each its own).
    with kernels.compile_cache(kernel_cache_dir()) as folder:
        summary = kernels.warmup(
            config.preset.name,
            int(kv_cache_spec.head_size),
            num_q_heads,
            int(kv_cache_spec.num_kv_heads),
            model.dtype,
            device,
            staging_tiles=config.ring_tiles,
            sink=config.sink,
            sliding_window=window,
            batch_invariant=config.batch_invariant,
            own_kv=own_kv,
            key_frame=config.key_frame,
            key_tiles=config.key_tiles,
            frame_queries=config.frame_queries,
        )
    logger.info(
        "kvarn: compiled the kernels before serving (%d launches, query blocks %s, %d "
        "thread(s), KVARN_KERNELS_WARMUP_THREADS) in %.1f s, Triton cache %s; %s=0 skips this "
        "and compiles them inside the first requests instead",
        summary["launches"],
        summary["query_block_sizes"],
        summary["threads"],
        summary["seconds"],
        folder or "as vLLM set it (the stable folder is not writable)",
        WARMUP_ENV,
    )
    return summary


def warm_planners(config: KvarnConfig, device: Any) -> bool:
    """Compile the device store planners of speculative steps (a verify step's
    ``plan_store_device`` and a drafter step's ``plan_draft_device``, one Triton variant each
    per engine configuration) on one scratch row, before vLLM serves. GPU only;
    ``KVARN_VLLM_WARMUP=0`` skips it. Returns whether it ran."""
    if not env_flag(WARMUP_ENV, True) or getattr(device, "type", "cpu") != "cuda":
        return False
    from kvarn_vllm import kernels
    from kvarn_vllm.plugin import kernel_cache_dir

    with kernels.compile_cache(kernel_cache_dir()):
        launch_planners(config, device)
    return True


def launch_planners(config: KvarnConfig, device: Any) -> None:
    """Both device planners once, on one scratch row (what :func:`warm_planners` compiles)."""
    import torch

    from kvarn_vllm import kernels

    one = torch.ones(1, dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    common = {
        "staging_tiles": config.ring_tiles,
        "sink": config.sink,
        "recent_tiles": config.recent_tiles,
        "window_keys": config.window_keys,
    }
    kernels.plan_store_device(
        one,
        torch.tensor([0, 1], dtype=torch.int32, device=device),
        zero,
        zero,
        zero,
        zero.view(1, 1),
        config.preset,
        max_tiles=1,
        max_writes=1,
        exact_start=zero,
        **common,
    )
    kernels.plan_draft_device(
        one, zero, zero, zero, config.preset, tokens_per_row=1, num_tokens=1, live_rows=1, **common
    )


def _align4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (int32 entries: 16 bytes)."""
    return -(-n // 4) * 4


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
        import heapq

        from kvarn_vllm.compat import first_tile_blocks

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
        channel = self

        class _Scope:
            def __enter__(self) -> None:
                channel._local.value = channel.in_draft_step + 1

            def __exit__(self, *exc: object) -> None:
                channel._local.value = channel.in_draft_step - 1

        return _Scope()

    @property
    def in_draft_step(self) -> int:
        return getattr(self._local, "value", 0)

    def proposing(self, attn_metadata: Any) -> Any:
        """Context manager around a DFlash proposal: ``attn_metadata`` (the target step's
        metadata by layer name, draft layers included) is :attr:`target_metadata` inside it,
        for the drafter's context store (``KvarnAttentionImpl.do_kv_cache_update``)."""
        channel = self

        class _Scope:
            def __enter__(self) -> None:
                channel._local.target = attn_metadata

            def __exit__(self, *exc: object) -> None:
                channel._local.target = None

        return _Scope()

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


STEP = _StepChannel()

# Per-process device state of speculative decoding, shared by every builder of the process
# (target groups, the drafter's own builders): tokens in quantized tiles per request-state
# row, and its value before the current step (so that every builder of a step, whichever
# runs first, plans from the same starting point); and per row the first position its
# request wrote itself (after its prefix-cache hit: where its exact copy in staging begins).
_SPEC_STATE: dict[str, Any] = {}


def _spec_state(device: Any, num_rows: int) -> dict[str, Any]:
    import torch

    key = str(device)
    state = _SPEC_STATE.get(key)
    if state is None or state["quantized"].numel() < num_rows:
        quantized = torch.zeros(num_rows, dtype=torch.int32, device=device)
        state = {
            "quantized": quantized,
            "before": quantized.clone(),
            "start": quantized.clone(),
            "serial": -1,
        }
        _SPEC_STATE[key] = state
    return state


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


@functools.lru_cache(maxsize=4)
def _encoded_table(max_blocks: int, max_reqs: int) -> np.ndarray:
    table = encoded_block_table(max_reqs, max_blocks)
    table.flags.writeable = False
    return table


def encoded_block_table(num_reqs: int, max_blocks: int) -> np.ndarray:
    """``[num_reqs, max_blocks]`` int32 with entry ``row * max_blocks + tile``.

    Handed to ``plan_store`` as the host block table; the builder maps the codes back to
    block ids through the device block table.
    """
    if num_reqs * max_blocks >= 2**31:
        raise ValueError(f"num_reqs * max_blocks must fit int32, got {num_reqs} * {max_blocks}")
    return np.arange(num_reqs * max_blocks, dtype=np.int32).reshape(num_reqs, max_blocks)


@dataclass(frozen=True)
class BatchSplit:
    """Batch rows by how their queries attend (see the module docstring).

    Attributes:
        decode, fresh, context: row indices (int32) of each kind, in batch order.
        uniform: the single kind every row has, or None for a mixed batch.
    """

    decode: np.ndarray
    fresh: np.ndarray
    context: np.ndarray
    uniform: str | None


def split_rows(num_cached: np.ndarray, num_new: np.ndarray) -> BatchSplit:
    """Classify rows: ``decode`` (1 new token after cached ones), ``fresh`` (nothing
    cached), ``context`` (several new tokens after cached ones). Rows with no new token
    (padding) belong to no kind: they have no query row to attend for."""
    num_cached = np.asarray(num_cached)
    num_new = np.asarray(num_new)
    if num_cached.shape != num_new.shape:
        raise ValueError(
            f"num_cached and num_new must match, got {num_cached.shape} and {num_new.shape}"
        )
    if (num_cached < 0).any() or (num_new < 0).any():
        raise ValueError("num_cached and num_new must be >= 0")
    fresh_mask = (num_cached == 0) & (num_new > 0)
    decode_mask = ~fresh_mask & (num_new == 1)
    context_mask = ~fresh_mask & (num_new > 1)
    rows = np.arange(num_new.shape[0], dtype=np.int32)
    parts = {"decode": rows[decode_mask], "fresh": rows[fresh_mask], "context": rows[context_mask]}
    nonempty = [k for k, v in parts.items() if v.size]
    # A kind is the whole batch only if every row is of it: a row without tokens (padding)
    # belongs to no kind, so such a batch takes the gathered path.
    uniform = nonempty[0] if len(nonempty) == 1 and parts[nonempty[0]].size == rows.size else None
    return BatchSplit(uniform=uniform, **parts)


@dataclass
class RowGroup:
    """Device tensors for one kind of rows (absent kinds are None in the metadata).

    Attributes:
        rows: ``[n]`` int32 batch rows, or None when the group is the whole batch.
        token_index: ``[t]`` int64 rows of query/key/value/output, or None (whole batch).
        query_start_loc: ``[n + 1]`` int32 within the gathered tokens.
        seq_lens, staging_slots: ``[n]`` int32.
        quantized_lens: ``[n]`` int32 tokens attention reads from quantized records (the
            plan's ``attention_lens``: with recent tiles, fewer than are quantized).
        block_table: ``[n, max_blocks]`` int32.
        max_query_len, max_seq_len, num_tokens: host ints.
        query_start_loc_host: ``[n + 1]`` int32 NumPy copy of ``query_start_loc``.
        sink_lens: ``[n]`` int32 (``G`` where the exact first tile is in staging), or None
            when the cache keeps no sink.
        sink_slots: ``[n]`` int32, the staging slot whose sink rows each row reads (its own,
            or the one holding a first tile it shares through the prefix cache), or None.
        key_lens: ``[n]`` int32 with values-only windows: attention reads keys from records
            before it (the plan's ``key_read_lens``), else None.
        host: NumPy copies of ``seq_lens``, ``quantized_lens``, ``sink_lens``,
            ``sink_slots``, ``staging_slots`` and ``key_lens`` where the host knows them
            exactly (no speculative decoding), else None.
        per_token: a decode group of query tokens, not requests (verify blocks as decode
            rows in a mixed step): ``rows`` maps each token to its batch row, the per-row
            tensors are per token (``seq_lens`` the token's position + 1), and there are
            ``num_tokens`` of them.
        expansion: a context group's tokens as decode rows, kept by the step's first layer
            for the others (:func:`kvarn_vllm.impl.row_expansion`).
    """

    rows: Any
    token_index: Any
    query_start_loc: Any
    seq_lens: Any
    quantized_lens: Any
    staging_slots: Any
    block_table: Any
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    query_start_loc_host: Any = None
    sink_lens: Any = None
    sink_slots: Any = None
    key_lens: Any = None
    host: dict[str, Any] | None = None
    per_token: bool = False
    expansion: Any = field(default=None, repr=False)


@dataclass
class KvarnMetadata:
    """Attention metadata of one step for the layers of one KV cache group.

    Attributes:
        num_reqs, num_actual_tokens: batch size and real tokens.
        plan: the ``StorePlan`` (device tensors, real block ids), or None for a dummy
            batch (profiling/warm-up: nothing is written, attention runs on fresh K/V).
        decode, fresh, context: the three kinds of rows (:class:`RowGroup` or None).
        causal: False for a drafter's non-causal block (DFlash): every query token of a
            context row attends the whole sequence, its block included.
    """

    num_reqs: int
    num_actual_tokens: int
    plan: Any
    decode: RowGroup | None
    fresh: RowGroup | None
    context: RowGroup | None
    causal: bool = True


def _make_builder_class() -> type:
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder

    class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
        """Plans each step once for every KVarN layer of a KV cache group."""

        # Full CUDA graphs for batches of single-token decodes: every tensor the kernels
        # read lives in a persistent buffer at a fixed offset, refreshed by build().
        _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            """Single-token decodes; with speculative decoding (unless
            ``KVARN_VLLM_SPEC_FULL_GRAPHS=0``), uniform batches of any length (verify steps,
            drafter steps), whose capture metadata :meth:`build_for_cudagraph_capture` lays
            out on the buffers a real step of that shape uses."""
            from kvarn_vllm.config import spec_full_graphs

            if getattr(vllm_config, "speculative_config", None) is not None and spec_full_graphs():
                return AttentionCGSupport.UNIFORM_BATCH
            return cls._cudagraph_support

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            import torch

            from kvarn_vllm import patches

            preset_name = getattr(kv_cache_spec, "kvarn_preset", "")
            spec_cfg = vllm_config.speculative_config
            self.speculative = spec_cfg is not None
            runner = "v2" if vllm_config.use_v2_model_runner else "v1"
            num_spec = 0
            if spec_cfg is not None:
                method = getattr(spec_cfg, "method", None)
                if method not in SPEC_METHODS[runner]:
                    other = [r for r, methods in SPEC_METHODS.items() if method in methods]
                    hint = (
                        f" kvarn serves {method!r} on vLLM's {other[0].upper()} model runner, "
                        f"and this configuration runs the {runner.upper()} runner (vLLM logs "
                        "why: 'Model Runner V2 does not yet support ...'; "
                        "VLLM_USE_V2_MODEL_RUNNER=1 or 0 chooses)."
                        if other
                        else ""
                    )
                    raise ValueError(
                        f"kvarn-vllm serves speculative decoding with the methods "
                        f"{', '.join(SPEC_METHODS['v2'])} (vLLM's V2 model runner) and "
                        f"{', '.join(SPEC_METHODS['v1'])} (V1); got method {method!r} (layers "
                        f"{layer_names[:2]}...).{hint} Use one of those methods, or "
                        "kv_cache_dtype auto/fp8 for this one."
                    )
                num_spec = int(spec_cfg.num_speculative_tokens or 0)
            patches.apply_worker_patches()
            from kvarn_vllm.impl import log_staging_once

            log_staging_once()
            self.config: KvarnConfig = parse_kv_cache_dtype(
                preset_name, num_speculative_tokens=num_spec
            )
            self.preset = self.config.preset
            sched = vllm_config.scheduler_config
            self.max_num_reqs = int(sched.max_num_seqs)
            self.max_num_tokens = max(
                int(sched.max_num_batched_tokens),
                int(getattr(sched, "max_num_scheduled_tokens", 0) or 0),
            )
            group = self.preset.group_size
            # A step completes at most one tile per request plus one per G fresh tokens.
            self.max_tiles = self.max_num_tokens // group + self.max_num_reqs
            self.max_writes = self.max_num_tokens
            r, t = self.max_num_reqs, self.max_num_tokens
            # One int32 buffer, fixed regions: plan tiles, plan writes, per-row vectors.
            # Regions start at 16-byte boundaries, as fresh tensors do: the store kernels
            # specialize on their plan pointers' alignment, so the variants warm_kernels
            # compiled on scratch tensors are the ones these views select.
            writes_at = _align4(self.max_tiles * 5)
            self._layout = {
                "tiles": (0, self.max_tiles * 5),
                "writes": (writes_at, self.max_writes * 4),
            }
            offset = _align4(writes_at + self.max_writes * 4)
            for name, size in (
                ("seq_lens", r),
                ("quantized_lens", r),
                ("read_lens", r),
                ("key_lens", r),
                ("slots", r),
                ("sink_lens", r),
                ("sink_slots", r),
                ("qsl", r + 1),
                ("drafts", r),
                ("new_rows", r),
            ):
                self._layout[name] = (offset, size)
                offset = _align4(offset + size)
            for kind in ("decode", "fresh", "context"):
                for name, size in (("rows", r), ("qsl", r + 1), ("tokens", t)):
                    self._layout[f"{kind}_{name}"] = (offset, size)
                    offset = _align4(offset + size)
            # A per-token decode group (verify blocks as decode rows in a mixed step): each
            # token's batch row and how many of its block's tokens come after it.
            for name in ("token_rows", "token_after"):
                self._layout[name] = (offset, t)
                offset = _align4(offset + t)
            self._device_buf = torch.zeros(offset, dtype=torch.int32, device=device)
            self._pin = torch.cuda.is_available() and device.type == "cuda"
            self._last_serial = -1
            self._spec = _spec_state(device, self.max_num_reqs) if self.speculative else None
            # Full CUDA graphs for uniform speculative batches: vLLM captures the target's
            # verify steps of 1 + k tokens per request.
            self._spec_graphs = (
                self.get_cudagraph_support(vllm_config, kv_cache_spec)
                == AttentionCGSupport.UNIFORM_BATCH
            )
            self._verify_len = 1 + num_spec
            from kvarn_vllm import kernels

            # Mixed steps' verify blocks join the decode rows, one per token (see _build).
            self._verify_rows_as_tokens = (
                self.config.verify_as_decode and not self.config.batch_invariant
            )
            self._verify_limit = kernels.verify_as_decode_max_query()
            # Per request-state row: the first position its request wrote itself (its
            # prefix-cache hit length), where the exact copy of its tokens in staging begins.
            self._exact_start = np.zeros(self.max_num_reqs, dtype=np.int64)
            # Verify rows (1 + k tokens) are "context" rows: multi_query_attention.
            self._init_reorder_batch_threshold(1)
            warm_kernels(self.config, kv_cache_spec, vllm_config, device)
            if self.speculative:
                warm_planners(self.config, device)

        def _view(self, buf, name: str, n: int, cols: int = 1):
            start, size = self._layout[name]
            if n * cols > size:
                raise ValueError(f"{name} needs {n * cols} entries, buffer holds {size}")
            view = buf[start : start + n * cols]
            return view.view(n, cols) if cols > 1 else view

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            record = STEP.record
            if self.speculative and STEP.in_draft_step:
                return self._build_draft_step(common_attn_metadata, record)
            fresh_step = record.slots is not None and record.serial != self._last_serial
            self._last_serial = record.serial
            return self._build(common_attn_metadata, record if fresh_step else None)

        def build_for_cudagraph_capture(self, common_attn_metadata):
            """The same buffers, shapes and kernels as a real step of this uniform batch;
            the plan is all padding, so nothing is written. Without speculation: single-token
            decodes. With it (unless ``KVARN_VLLM_SPEC_FULL_GRAPHS=0``), vLLM captures only uniform
            speculative batches: ``1 + k`` causal tokens per request are the target's verify
            step (or EAGLE's first draft step, which reuses its metadata); one token per
            request or a non-causal block is a drafter's step (:meth:`_build_draft_step`)."""
            cam = common_attn_metadata
            if self._spec_graphs:
                qlens = np.diff(cam.query_start_loc_cpu[: int(cam.num_reqs) + 1].numpy())
                if int(qlens.max(initial=0)) == 1 or not getattr(cam, "causal", True):
                    dummy = StepRecord(serial=-1, num_reqs=0, slots=None)
                    return self._build_draft_step(cam, dummy, capture=True)
            return self._build(cam, None, capture=True)

        def _build(self, cam, record: StepRecord | None, capture: bool = False):
            import torch

            from kvarn_vllm import kernels

            num_reqs = int(cam.num_reqs)
            qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int32)
            num_new = np.diff(qsl).astype(np.int32)
            if cam.seq_lens_cpu_upper_bound is not None:
                seq_lens = cam.seq_lens_cpu_upper_bound[:num_reqs].numpy().astype(np.int32)
            else:  # not reached with the V2 runner, which always passes the host copy
                seq_lens = cam.seq_lens[:num_reqs].cpu().numpy().astype(np.int32)
            slots = np.zeros(num_reqs, dtype=np.int32)
            if record is not None:
                assert record.slots is not None  # build() passes only real steps' records
                real = min(record.num_reqs, num_reqs)
                slots[:real] = record.slots[:real]
                if slots.size and slots.max() >= self.max_num_reqs:
                    raise ValueError(
                        f"staging slot {slots.max()} out of range: kvarn has "
                        f"{self.max_num_reqs} (max_num_seqs)"
                    )
            elif capture and self._spec_graphs:
                seq_lens = num_new.copy()  # as vLLM's dummy batch: the rows' own tokens
            elif capture:
                seq_lens = np.minimum(num_new, 1).astype(np.int32)
            else:
                # Profiling/warm-up batch: throwaway K/V, attended exactly, nothing stored.
                seq_lens = num_new.copy()
            num_cached = seq_lens - num_new
            block_table = cam.block_table_tensor[:num_reqs]
            max_blocks = int(block_table.shape[1])
            # Single-token decodes, possibly with padding rows (no tokens) of a CUDA graph.
            uniform_decode = bool((num_new <= 1).all()) and bool((num_new == 1).any())
            # With full graphs for speculative batches: a verify step whose rows bring
            # 1 + k tokens each, or none (padding rows of a graph), runs as one uniform
            # context group on the persistent buffers, as the capture laid them out.
            q_uniform = int(num_new.max(initial=0))
            uniform_verify = (
                self._spec_graphs
                and q_uniform == self._verify_len > 1
                and bool(((num_new == 0) | (num_new == q_uniform)).all())
            )

            host = np.zeros(self._device_buf.numel(), dtype=np.int32)
            plan = None
            quantized = np.zeros(num_reqs, dtype=np.int32)
            read = quantized
            key_read = read  # values-only windows: where exact keys start
            on_device = self.speculative and (record is not None or (capture and uniform_verify))
            if record is not None and record.new_rows is not None:
                real = min(record.num_reqs, num_reqs)
                added = np.flatnonzero(np.asarray(record.new_rows[:real], dtype=bool))
                g = self.preset.group_size
                self._exact_start[slots[added]] = num_cached[added] // g * g
            if on_device:
                # Lengths on the host are upper bounds (accepted drafts are known on the
                # GPU only): the plan is made on the device after the copy below. A capture
                # (no record) has no drafts and no new rows; its device plan is all padding.
                if record is not None:
                    real = min(record.num_reqs, num_reqs)
                    for name, values in (
                        ("drafts", record.num_drafts),
                        ("new_rows", record.new_rows),
                    ):
                        if values is not None:
                            s, _ = self._layout[name]
                            host[s : s + real] = np.asarray(values[:real], dtype=np.int32)
            elif record is not None or capture:
                plan = kernels.plan_store(
                    num_cached if record is not None else np.zeros(num_reqs, np.int32),
                    num_new if record is not None else np.zeros(num_reqs, np.int32),
                    None,
                    slots,
                    _encoded_table(max_blocks, self.max_num_reqs)[:num_reqs],
                    self.preset,
                    staging_tiles=self.config.ring_tiles,
                    query_start_loc=qsl,
                    max_tiles=num_reqs if uniform_decode else None,
                    max_writes=num_reqs if uniform_decode else None,
                    sink=self.config.sink,
                    recent_tiles=self.config.recent_tiles,
                    window_keys=self.config.window_keys,
                    # (never past what is cached: a row whose request was not reported
                    # as added keeps a start that may be stale; the plan then stays safe)
                    exact_start=np.minimum(
                        self._exact_start[slots],
                        num_cached // self.preset.group_size * self.preset.group_size,
                    )
                    if record is not None
                    else None,
                )
                if record is not None:
                    quantized = np.asarray(plan.quantized_lens, dtype=np.int32)
                    read = np.asarray(plan.attention_lens, dtype=np.int32)
                    if plan.key_read_lens is not None:
                        key_read = np.asarray(plan.key_read_lens, dtype=np.int32)
                for name, values in (("tiles", plan.tiles), ("writes", plan.writes)):
                    s, _ = self._layout[name]
                    flat = np.asarray(values, dtype=np.int32).reshape(-1)
                    host[s : s + flat.size] = flat
            sink_lens = np.zeros(num_reqs, dtype=np.int32)
            sink_slots = np.asarray(slots, dtype=np.int32)
            if self.config.sink and record is not None:
                sink_lens, sink_slots = sink_rows_for(
                    record, slots, num_cached, self.preset.group_size, self.max_num_reqs
                )
            for name, values in (
                ("seq_lens", seq_lens),
                ("quantized_lens", quantized),
                ("read_lens", read),
                ("key_lens", key_read),
                ("slots", slots),
                ("sink_lens", sink_lens),
                ("sink_slots", sink_slots),
                ("qsl", qsl),
            ):
                s, _ = self._layout[name]
                host[s : s + values.size] = values

            if uniform_verify and (capture or record is not None):
                rows = np.arange(num_reqs, dtype=np.int32)
                empty = np.zeros(0, dtype=np.int32)
                split = BatchSplit(decode=empty, fresh=empty, context=rows, uniform="context")
            elif capture or (record is not None and uniform_decode):
                rows = np.arange(num_reqs, dtype=np.int32)
                empty = np.zeros(0, dtype=np.int32)
                split = BatchSplit(decode=rows, fresh=empty, context=empty, uniform="decode")
            else:
                split = split_rows(num_cached, num_new)
            token_rows = None
            if (
                self._verify_rows_as_tokens
                and not (capture or uniform_verify)
                and split.context.size
            ):
                # Verify blocks as decode rows in a mixed step (some requests drafted fewer
                # tokens, or none, or a prompt chunk came along): the step runs outside a
                # full CUDA graph, so the short blocks join the decode rows, one decode row
                # per query token, and each layer makes one decode call over them, with the
                # per-token lengths and tables gathered here once per step instead of in
                # every layer's call. (A uniform verify step keeps its context group: a full
                # graph captures that group's per-layer gathers on the persistent buffers.)
                short = split.context[num_new[split.context] <= self._verify_limit]
                if short.size:
                    joined = np.sort(np.concatenate([split.decode, short]))
                    split = BatchSplit(
                        decode=joined,
                        fresh=split.fresh,
                        context=np.setdiff1d(split.context, short).astype(np.int32),
                        uniform=None,
                    )
                    token_rows = np.repeat(joined, num_new[joined]).astype(np.int32)
            group_hosts = {}
            for kind in ("decode", "fresh", "context"):
                rows = getattr(split, kind)
                if not rows.size:
                    continue
                starts, lens = qsl[rows], num_new[rows]
                if split.uniform == kind:
                    n_tokens = int(qsl[-1])
                    sub_qsl = qsl
                else:
                    tokens = (
                        np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
                        if lens.sum()
                        else np.zeros(0, dtype=np.int32)
                    )
                    sub_qsl = np.zeros(rows.size + 1, dtype=np.int32)
                    np.cumsum(lens, out=sub_qsl[1:])
                    for name, values in (("rows", rows), ("qsl", sub_qsl), ("tokens", tokens)):
                        s, _ = self._layout[f"{kind}_{name}"]
                        host[s : s + values.size] = values
                    n_tokens = int(tokens.size)
                group_hosts[kind] = (
                    rows,
                    n_tokens,
                    int(lens.max(initial=0)),
                    int(seq_lens[rows].max(initial=0)),
                    sub_qsl,
                )

            token_after = None
            if token_rows is not None:
                # How many of its block's tokens come after each of the group's tokens (which
                # the loop above wrote for its token_index).
                tokens = self._view(host, "decode_tokens", token_rows.size)
                token_after = (qsl[token_rows + 1] - 1 - tokens).astype(np.int32)
                for name, values in (("token_rows", token_rows), ("token_after", token_after)):
                    s, _ = self._layout[name]
                    host[s : s + values.size] = values
                rows, _, _, _, sub_qsl = group_hosts["decode"]
                group_hosts["decode"] = (
                    rows,
                    int(token_rows.size),
                    1,
                    int((seq_lens[token_rows] - token_after).max(initial=0)),
                    sub_qsl,
                )

            # One host -> device copy for everything the kernels read this step.
            used = self._used_prefix(num_reqs, group_hosts, split.uniform)
            if token_rows is not None:
                used = max(used, self._layout["token_after"][0] + token_rows.size)
            # A device plan writes the plan regions itself: copy from the per-row vectors on.
            lo = self._layout["seq_lens"][0] if on_device else 0
            src = torch.from_numpy(host[lo:used])
            if self._pin:
                src = src.pin_memory()
            self._device_buf[lo:used].copy_(src, non_blocking=True)
            buf = self._device_buf

            dev_seq = self._view(buf, "seq_lens", num_reqs)
            dev_read = self._view(buf, "read_lens", num_reqs)  # attention's split
            dev_keys = None if self.config.window_keys else self._view(buf, "key_lens", num_reqs)
            dev_slots = self._view(buf, "slots", num_reqs)
            dev_sink = self._view(buf, "sink_lens", num_reqs) if self.config.sink else None
            dev_sink_slots = self._view(buf, "sink_slots", num_reqs) if self.config.sink else None
            dev_plan = None
            if on_device:
                # Write rows for every token of the (padded) step: a graph replays the
                # capture's shapes, and tokens past the real ones plan nothing.
                width = max(int(qsl[-1]), int(cam.num_actual_tokens))
                dev_plan = self._device_plan(cam, record, num_reqs, width, buf)
            elif plan is not None:
                tiles = self._view(buf, "tiles", plan.tiles.shape[0], 5)
                writes = self._view(buf, "writes", plan.writes.shape[0], 4)
                if tiles.shape[0]:
                    # Encoded (row * max_blocks + tile) -> block id, on the device.
                    flat = block_table.reshape(-1)
                    code = tiles[:, 0]
                    ids = flat[code.clamp(min=0).long()].to(torch.int32)
                    tiles[:, 0] = torch.where(code >= 0, ids, code)
                dev_plan = self._plan_views(plan, buf, num_reqs, tiles, writes)

            groups: dict[str, RowGroup | None] = {"decode": None, "fresh": None, "context": None}
            for kind, (rows, n_tokens, max_q, max_s, sub_qsl) in group_hosts.items():
                if split.uniform == kind:
                    groups[kind] = RowGroup(
                        rows=None,
                        token_index=None,
                        query_start_loc=self._view(buf, "qsl", num_reqs + 1),
                        seq_lens=dev_seq,
                        quantized_lens=dev_read,
                        staging_slots=dev_slots,
                        block_table=block_table,
                        max_query_len=max_q,
                        max_seq_len=max_s,
                        num_tokens=n_tokens,
                        query_start_loc_host=sub_qsl,
                        sink_lens=dev_sink,
                        sink_slots=dev_sink_slots,
                        key_lens=dev_keys,
                    )
                    continue
                if kind == "decode" and token_rows is not None:
                    groups[kind] = self._token_group(
                        buf, n_tokens, max_s, block_table, dev_seq, dev_read, dev_slots,
                        dev_sink, dev_sink_slots, dev_keys, whole=n_tokens == int(qsl[-1]),
                    )  # fmt: skip
                    continue
                dev_rows = self._view(buf, f"{kind}_rows", rows.size).long()
                groups[kind] = RowGroup(
                    rows=dev_rows,
                    token_index=self._view(buf, f"{kind}_tokens", n_tokens).long(),
                    query_start_loc=self._view(buf, f"{kind}_qsl", rows.size + 1),
                    seq_lens=dev_seq[dev_rows],
                    quantized_lens=dev_read[dev_rows],
                    staging_slots=dev_slots[dev_rows],
                    block_table=block_table[dev_rows],
                    max_query_len=max_q,
                    max_seq_len=max_s,
                    num_tokens=n_tokens,
                    query_start_loc_host=sub_qsl,
                    sink_lens=None if dev_sink is None else dev_sink[dev_rows],
                    sink_slots=None if dev_sink_slots is None else dev_sink_slots[dev_rows],
                    key_lens=None if dev_keys is None else dev_keys[dev_rows],
                )
            if not on_device:
                for kind, (rows, *_rest) in group_hosts.items():
                    group = groups[kind]
                    if group is not None and group.per_token:
                        assert token_rows is not None and token_after is not None
                        group.host = {
                            "seq_lens": seq_lens[token_rows] - token_after,
                            "quantized_lens": read[token_rows],
                            "sink_lens": sink_lens[token_rows],
                            "sink_slots": sink_slots[token_rows],
                            "staging_slots": slots[token_rows],
                            "key_lens": key_read[token_rows],
                        }
                    elif group is not None:
                        group.host = {
                            "seq_lens": seq_lens[rows],
                            "quantized_lens": read[rows],
                            "sink_lens": sink_lens[rows],
                            "sink_slots": sink_slots[rows],
                            "staging_slots": slots[rows],
                            "key_lens": key_read[rows],
                        }
            return KvarnMetadata(
                num_reqs=num_reqs,
                num_actual_tokens=int(cam.num_actual_tokens),
                plan=dev_plan,
                decode=groups["decode"],
                fresh=groups["fresh"],
                context=groups["context"],
            )

        def _device_plan(self, cam, record: StepRecord | None, num_reqs: int, num_tokens: int, buf):
            """This step's store plan from the device lengths (speculative decoding).

            ``cam.seq_lens`` is exact on the device; the committed length of a row is
            ``seq_len - num_drafts``. Tiles already quantized come from the shared
            per-row state, reset for requests (re)added this step. ``record`` None: a CUDA
            graph capture, whose plan has the real step's shapes and writes nothing.
            """
            import torch

            from kvarn_vllm import kernels

            g = self.preset.group_size
            seq = cam.seq_lens[:num_reqs].to(torch.int32)
            qsl = self._view(buf, "qsl", num_reqs + 1)
            slots = self._view(buf, "slots", num_reqs)
            drafts = self._view(buf, "drafts", num_reqs)
            new_rows = self._view(buf, "new_rows", num_reqs)
            spec = self._spec
            if record is not None and spec["serial"] != record.serial:
                spec["before"].copy_(spec["quantized"])
                spec["serial"] = record.serial
            floor = (seq - (qsl[1:] - qsl[:-1])) // g * g
            before = spec["before"][slots.long()]
            before = torch.where(new_rows > 0, floor, torch.minimum(before, floor))
            real = 0 if record is None else min(record.num_reqs, num_reqs)
            start = torch.where(new_rows > 0, floor, spec["start"][slots.long()])
            if self.config.recent_tiles or not self.config.window_keys:
                spec["start"].index_copy_(0, slots[:real].long(), start[:real])
            out = self._plan_out(buf, num_reqs, self.max_tiles, num_tokens)
            tiles, writes = out.tiles, out.writes
            plan = kernels.plan_store_device(
                seq,
                qsl,
                drafts,
                before,
                slots,
                cam.block_table_tensor[:num_reqs],
                self.preset,
                staging_tiles=self.config.ring_tiles,
                max_tiles=self.max_tiles,
                max_writes=num_tokens,
                sink=self.config.sink,
                recent_tiles=self.config.recent_tiles,
                exact_start=start,
                window_keys=self.config.window_keys,
                out=out,
            )
            if record is None:
                tiles.fill_(-1)
                writes.fill_(-1)
            spec["quantized"].index_copy_(0, slots[:real].long(), plan.quantized_lens[:real])
            return self._plan_views(plan, buf, num_reqs, tiles, writes)

        def _plan_out(self, buf, num_reqs: int, num_tiles: int, num_tokens: int):
            """The step's buffer views a device planner writes its plan into (what CUDA
            graphs replay), with this engine's plan settings."""
            from kvarn_kernels import StorePlan

            cfg = self.config
            return StorePlan(
                tiles=self._view(buf, "tiles", num_tiles, 5),
                writes=self._view(buf, "writes", num_tokens, 4),
                seq_lens=self._view(buf, "seq_lens", num_reqs),
                quantized_lens=self._view(buf, "quantized_lens", num_reqs),
                num_tiles=num_tiles,
                num_writes=num_tokens,
                group_size=self.preset.group_size,
                staging_tiles=cfg.ring_tiles,
                sink=cfg.sink,
                recent_tiles=cfg.recent_tiles,
                read_lens=self._view(buf, "read_lens", num_reqs),
                window_keys=cfg.window_keys,
                key_read_lens=None if cfg.window_keys else self._view(buf, "key_lens", num_reqs),
            )

        def _plan_views(self, plan, buf, num_reqs: int, tiles, writes):
            """``plan`` on the persistent buffer: its tiles and writes as given, its per-row
            lengths as the buffer's views (what CUDA graphs replay)."""
            read = self._view(buf, "read_lens", num_reqs)
            return replace(
                plan,
                tiles=tiles,
                writes=writes,
                seq_lens=self._view(buf, "seq_lens", num_reqs),
                quantized_lens=self._view(buf, "quantized_lens", num_reqs),
                read_lens=None if plan.read_lens is None else read,
                key_read_lens=None
                if plan.key_read_lens is None
                else self._view(buf, "key_lens", num_reqs),
            )

        def _build_draft_step(self, cam, record: StepRecord, capture: bool = False):
            """A drafter's step: ``n`` draft tokens per row at its last ``n`` positions, one
            for EAGLE/MTP steps 2..k, a block of ``1 + k`` for DFlash (non-causal when
            ``cam.causal`` is False). Rows without tokens (padding) come last.

            Its tokens are drafts: they go to staging and nothing is committed (the
            drafter's layers commit with the target's plan of the next step, which rewrites
            these positions). ``capture``: a CUDA graph capture, which keeps the (empty)
            store plan so that the graph holds the store; write rows cover every token of
            the padded step.
            """
            import torch

            from kvarn_vllm import kernels

            num_reqs = int(cam.num_reqs)
            qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int32)
            qlens = np.diff(qsl)
            n = max(1, int(qlens.max(initial=0)))
            live = int(np.count_nonzero(qlens))
            if np.any(qlens[:live] != n) or np.any(qlens[live:] != 0):
                raise ValueError(
                    "kvarn-vllm: a drafter step whose requests bring different numbers of "
                    f"query tokens ({sorted(set(qlens.tolist()))}) is not supported"
                )
            causal = getattr(cam, "causal", True)
            if not isinstance(causal, bool):
                raise ValueError(
                    f"kvarn-vllm: a drafter step's causal flag must be one bool, got {causal!r}"
                )
            num_tokens = max(int(qsl[-1]), int(cam.num_actual_tokens))
            rslots = record.slots
            real = min(record.num_reqs, num_reqs) if rslots is not None else 0
            host = np.zeros(self._device_buf.numel(), dtype=np.int32)
            if rslots is not None and real:
                s, _ = self._layout["slots"]
                host[s : s + real] = rslots[:real]
                if self.config.sink:
                    # Rows were (re)added in the target step of this record, which already
                    # decided their sink; num_cached does not matter here.
                    lens, sink_slots = sink_rows_for(
                        record,
                        np.asarray(rslots[:real], dtype=np.int32),
                        np.zeros(real, dtype=np.int32),
                        self.preset.group_size,
                        self.max_num_reqs,
                    )
                    s, _ = self._layout["sink_lens"]
                    host[s : s + real] = lens
                    s, _ = self._layout["sink_slots"]
                    host[s : s + real] = sink_slots
            s, _ = self._layout["qsl"]
            host[s : s + num_reqs + 1] = qsl
            # The per-row vectors only: the draft planner writes the plan regions.
            lo, used = self._layout["seq_lens"][0], self._layout["qsl"][0] + num_reqs + 1
            src = torch.from_numpy(host[lo:used])
            if self._pin:
                src = src.pin_memory()
            self._device_buf[lo:used].copy_(src, non_blocking=True)
            buf = self._device_buf
            seq = cam.seq_lens[:num_reqs]
            if not real:  # dummy (profiling) draft step: attend the row's own tokens only
                seq = seq.clamp(max=n)
            slots = self._view(buf, "slots", num_reqs)
            out = self._plan_out(buf, num_reqs, num_reqs, num_tokens)
            dev_seq, dev_read, dev_keys = out.seq_lens, out.read_lens, out.key_read_lens
            # Every draft goes to staging, nothing is quantized; one launch writes the
            # lengths, windows and write rows into the step's buffer views.
            plan = kernels.plan_draft_device(
                seq,
                slots,
                self._spec["quantized"],
                self._spec["start"],
                self.preset,
                tokens_per_row=n,
                num_tokens=num_tokens,
                live_rows=real,
                staging_tiles=self.config.ring_tiles,
                sink=self.config.sink,
                recent_tiles=self.config.recent_tiles,
                window_keys=self.config.window_keys,
                out=out,
            )
            group = RowGroup(
                rows=None,
                token_index=None,
                query_start_loc=self._view(buf, "qsl", num_reqs + 1),
                seq_lens=dev_seq,
                quantized_lens=dev_read,
                staging_slots=slots,
                block_table=cam.block_table_tensor[:num_reqs],
                max_query_len=n,
                max_seq_len=int(cam.max_seq_len),
                num_tokens=num_tokens,
                query_start_loc_host=qsl,
                sink_lens=self._view(buf, "sink_lens", num_reqs) if self.config.sink else None,
                sink_slots=self._view(buf, "sink_slots", num_reqs) if self.config.sink else None,
                key_lens=dev_keys,
            )
            # One token per row attends as decode; a block as context rows (multi-query).
            block = n > 1 or not causal
            return KvarnMetadata(
                num_reqs=num_reqs,
                num_actual_tokens=int(cam.num_actual_tokens),
                plan=plan if real or capture else None,
                decode=None if block else group,
                fresh=None,
                context=group if block else None,
                causal=causal,
            )

        def _token_group(
            self, buf, n_tokens, max_seq, block_table, dev_seq, dev_read, dev_slots,
            dev_sink, dev_sink_slots, dev_keys, whole,
        ):  # fmt: skip
            """The per-token decode group of a mixed step (:attr:`RowGroup.per_token`): the
            per-row tensors gathered for each token from the step's persistent buffers (on
            the device, after the device plan has written the lengths), each token's length
            its position + 1."""
            from kvarn_vllm import kernels

            trow = self._view(buf, "token_rows", n_tokens).long()
            after = self._view(buf, "token_after", n_tokens)
            return RowGroup(
                rows=trow,
                token_index=None if whole else self._view(buf, "decode_tokens", n_tokens).long(),
                query_start_loc=None,
                seq_lens=dev_seq.index_select(0, trow) - after,
                max_query_len=1,
                max_seq_len=max_seq,
                num_tokens=n_tokens,
                per_token=True,
                **kernels.row_tables(
                    trow, block_table, dev_read, dev_slots, dev_sink, dev_sink_slots, dev_keys
                )._asdict(),
            )

        def _used_prefix(self, num_reqs: int, group_hosts: dict, uniform: str | None) -> int:
            # Copy only up to the last region this step uses.
            end = self._layout["new_rows"][0] + num_reqs
            for kind, (_rows, n_tokens, _, _, _) in group_hosts.items():
                if kind != uniform:
                    end = max(end, self._layout[f"{kind}_tokens"][0] + n_tokens)
            return end

    KvarnMetadataBuilder.__module__ = __name__
    KvarnMetadataBuilder.__qualname__ = "KvarnMetadataBuilder"
    return KvarnMetadataBuilder


_BUILDER: type | None = None


def __getattr__(name: str) -> Any:
    global _BUILDER
    if name == "KvarnMetadataBuilder":
        if _BUILDER is None:
            _BUILDER = _make_builder_class()
            globals()["KvarnMetadataBuilder"] = _BUILDER
        return _BUILDER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
