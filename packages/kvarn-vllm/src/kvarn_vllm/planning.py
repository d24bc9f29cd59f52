"""Per-step planning: once per step and KV cache group, not per layer.

Each step the planner

1. takes every request's staging slot from what the model runner reported
   (:data:`kvarn_vllm.step.STEP`): the V2 runner's request-state row, or on the V1 runner a
   slot kept by request id; either way a slot is never shared by two live requests;
2. calls ``kvarn_kernels.plan_store`` once (host NumPy) for the whole batch, or under
   speculative decoding, where only the device knows the accepted lengths, a device planner
   (:mod:`kvarn_vllm.speculative`);
3. splits the rows into the three kinds of :mod:`kvarn_vllm.metadata`, each served by one
   attention call per layer;
4. copies everything the kernels read into the persistent buffer
   (:class:`kvarn_vllm.buffers.StepBuffers`) with one host to device copy, so full CUDA
   graphs of uniform batches replay with fresh values.

The block ids of the tiles to quantize are resolved on the device: ``plan_store`` sees a
host table of *encoded* positions ``row * max_blocks + tile`` (vLLM 0.26 keeps block tables
on the GPU only), and the planner gathers the real ids from the device block table.
Nothing here synchronizes with the GPU, and nothing imports vLLM:
:class:`kvarn_vllm.builder.KvarnMetadataBuilder` is the vLLM class that hands steps here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from kvarn_vllm import kernels, speculative
from kvarn_vllm.buffers import ROW_KINDS, StepBuffers
from kvarn_vllm.config import KvarnConfig
from kvarn_vllm.metadata import BatchSplit, KvarnMetadata, RowGroup, encoded_table, split_rows
from kvarn_vllm.sink import sink_rows_for
from kvarn_vllm.step import STEP, StepRecord

__all__ = ["StepPlanner"]

_VECTORS = ("seq_lens", "quantized_lens", "read_lens", "key_lens", "slots", "sink_lens")


@dataclass
class _HostStep:
    """A target step as the host sees it, filled in stage by stage (all NumPy int32 arrays of
    ``num_reqs`` rows unless named otherwise)."""

    num_reqs: int
    qsl: np.ndarray  # [num_reqs + 1] query start of each row
    num_new: np.ndarray
    seq_lens: np.ndarray  # upper bounds under speculative decoding
    slots: np.ndarray
    block_table: Any  # [num_reqs, max_blocks] int32 device tensor
    uniform_decode: bool  # single-token decodes (and padding rows without tokens)
    uniform_verify: bool  # a uniform verify step on the full graphs' buffers
    on_device: bool  # the store plan is made on the device (speculative decoding)
    host: np.ndarray  # the whole buffer's host copy
    plan: Any = None  # the host StorePlan, or None
    quantized: np.ndarray | None = None
    read: np.ndarray | None = None
    key_read: np.ndarray | None = None
    sink_lens: np.ndarray | None = None
    sink_slots: np.ndarray | None = None
    split: BatchSplit | None = None
    token_rows: np.ndarray | None = None  # per-token decode group: each token's batch row
    token_after: np.ndarray | None = None  # ... and how many of its block's tokens follow it
    # per kind: (rows, num_tokens, max_query_len, max_seq_len, query_start_loc_host)
    group_hosts: dict[str, tuple[Any, int, int, int, Any]] = field(default_factory=dict)

    @property
    def num_cached(self) -> np.ndarray:
        return self.seq_lens - self.num_new


class _RowViews(NamedTuple):
    """The per-row device vectors of a step's buffer (``[num_reqs]`` int32 each)."""

    seq: Any
    read: Any
    keys: Any
    slots: Any
    sink: Any
    sink_slots: Any


class StepPlanner:
    """Plans every step of one KV cache group; :meth:`plan` returns its metadata.

    Args:
        config: the engine's kvarn settings (preset, staging ring, sink, windows).
        max_num_reqs, max_num_tokens: vLLM's scheduler limits.
        device: where the step's buffer lives.
        spec_decode: speculative decoding is on (plans are made on the device).
        spec_graphs: full CUDA graphs of uniform speculative batches.
        verify_len: ``1 + k`` tokens of a verify block.
    """

    def __init__(
        self,
        config: KvarnConfig,
        max_num_reqs: int,
        max_num_tokens: int,
        device: Any,
        spec_decode: bool,
        spec_graphs: bool,
        verify_len: int,
    ) -> None:
        self.config = config
        self.preset = config.preset
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        # A step completes at most one tile per request plus one per G fresh tokens.
        self.max_tiles = max_num_tokens // self.preset.group_size + max_num_reqs
        self.max_writes = max_num_tokens
        self.buffers = StepBuffers(
            max_num_reqs, max_num_tokens, self.max_tiles, self.max_writes, device
        )
        self.last_serial = -1
        self.speculative = spec_decode
        self.spec = speculative.spec_state(device, max_num_reqs) if spec_decode else None
        self.spec_graphs = spec_graphs
        self.verify_len = verify_len
        # Mixed steps' verify blocks join the decode rows, one per token (see _split).
        self.verify_rows_as_tokens = config.verify_as_decode and not config.batch_invariant
        self.verify_limit = kernels.verify_as_decode_max_query()
        # Per request-state row: the first position its request wrote itself (its
        # prefix-cache hit length), where the exact copy of its tokens in staging begins.
        self.exact_start = np.zeros(max_num_reqs, dtype=np.int64)

    def view(self, buf: Any, name: str, n: int, cols: int = 1) -> Any:
        """Region ``name`` of ``buf`` (:meth:`StepBuffers.view`)."""
        return self.buffers.view(buf, name, n, cols)

    def plan(self, cam: Any) -> KvarnMetadata:
        """The metadata of the step ``cam`` (vLLM's ``CommonAttentionMetadata``) describes,
        from what the runner reported for it; a build the runner did not report (profiling,
        warm-up) is a dummy batch that stores nothing."""
        record = STEP.record
        if self.speculative and STEP.in_draft_step:
            return speculative.draft_step(self, cam, record)
        fresh_step = record.slots is not None and record.serial != self.last_serial
        self.last_serial = record.serial
        return self.plan_step(cam, record if fresh_step else None)

    def plan_capture(self, cam: Any) -> KvarnMetadata:
        """The same buffers, shapes and kernels as a real step of this uniform batch; the
        plan is all padding, so nothing is written. Without speculation: single-token
        decodes. With full graphs of speculative batches, ``1 + k`` causal tokens per request
        are the target's verify step (or EAGLE's first draft step, which reuses its
        metadata); one token per request or a non-causal block is a drafter's step."""
        if self.spec_graphs:
            qlens = np.diff(cam.query_start_loc_cpu[: int(cam.num_reqs) + 1].numpy())
            if int(qlens.max(initial=0)) == 1 or not getattr(cam, "causal", True):
                dummy = StepRecord(serial=-1, num_reqs=0, slots=None)
                return speculative.draft_step(self, cam, dummy, capture=True)
        return self.plan_step(cam, None, capture=True)

    def plan_step(self, cam: Any, record: StepRecord | None, capture: bool = False) -> Any:
        """A target step: ``record`` None for a dummy batch (profiling, warm-up) or a CUDA
        graph capture (``capture``), which plan nothing."""
        step = self._host_step(cam, record, capture)
        self._host_plan(step, cam, record, capture)
        self._split(step, record, capture)
        self._group_hosts(step)
        # One host -> device copy for everything the kernels read this step.
        used = self._used_prefix(step)
        # A device plan writes the plan regions itself: copy from the per-row vectors on.
        lo = self.buffers.start("seq_lens") if step.on_device else 0
        self.buffers.upload(step.host, lo, used)
        buf = self.buffers.device_buf
        num_reqs = step.num_reqs
        sink = self.config.sink
        views = _RowViews(
            seq=self.view(buf, "seq_lens", num_reqs),
            read=self.view(buf, "read_lens", num_reqs),  # attention's split
            keys=None if self.config.window_keys else self.view(buf, "key_lens", num_reqs),
            slots=self.view(buf, "slots", num_reqs),
            sink=self.view(buf, "sink_lens", num_reqs) if sink else None,
            sink_slots=self.view(buf, "sink_slots", num_reqs) if sink else None,
        )
        # The plan first: a device plan writes the lengths the groups gather.
        dev_plan = self._device_plan(step, cam, record, buf)
        groups = self._groups(step, buf, views)
        if not step.on_device:
            _attach_host(step, groups)
        return KvarnMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=int(cam.num_actual_tokens),
            plan=dev_plan,
            decode=groups["decode"],
            fresh=groups["fresh"],
            context=groups["context"],
        )

    def _host_step(self, cam: Any, record: StepRecord | None, capture: bool) -> _HostStep:
        """The step's lengths, slots and shape on the host."""
        num_reqs = int(cam.num_reqs)
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int32)
        num_new = np.diff(qsl).astype(np.int32)
        if cam.seq_lens_cpu_upper_bound is not None:
            seq_lens = cam.seq_lens_cpu_upper_bound[:num_reqs].numpy().astype(np.int32)
        else:  # not reached with the V2 runner, which always passes the host copy
            seq_lens = cam.seq_lens[:num_reqs].cpu().numpy().astype(np.int32)
        slots = np.zeros(num_reqs, dtype=np.int32)
        if record is not None:
            assert record.slots is not None  # plan() passes only real steps' records
            real = min(record.num_reqs, num_reqs)
            slots[:real] = record.slots[:real]
            if slots.size and slots.max() >= self.max_num_reqs:
                raise ValueError(
                    f"staging slot {slots.max()} out of range: kvarn has "
                    f"{self.max_num_reqs} (max_num_seqs)"
                )
        elif capture and self.spec_graphs:
            seq_lens = num_new.copy()  # as vLLM's dummy batch: the rows' own tokens
        elif capture:
            seq_lens = np.minimum(num_new, 1).astype(np.int32)
        else:
            # Profiling/warm-up batch: throwaway K/V, attended exactly, nothing stored.
            seq_lens = num_new.copy()
        # With full graphs for speculative batches: a verify step whose rows bring
        # 1 + k tokens each, or none (padding rows of a graph), runs as one uniform
        # context group on the persistent buffers, as the capture laid them out.
        q_uniform = int(num_new.max(initial=0))
        uniform_verify = (
            self.spec_graphs
            and q_uniform == self.verify_len > 1
            and bool(((num_new == 0) | (num_new == q_uniform)).all())
        )
        return _HostStep(
            num_reqs=num_reqs,
            qsl=qsl,
            num_new=num_new,
            seq_lens=seq_lens,
            slots=slots,
            block_table=cam.block_table_tensor[:num_reqs],
            # Single-token decodes, possibly with padding rows (no tokens) of a CUDA graph.
            uniform_decode=bool((num_new <= 1).all()) and bool((num_new == 1).any()),
            uniform_verify=uniform_verify,
            on_device=self.speculative and (record is not None or (capture and uniform_verify)),
            host=self.buffers.host(),
        )

    def _host_plan(
        self, step: _HostStep, cam: Any, record: StepRecord | None, capture: bool
    ) -> None:
        """The host store plan (or, for a device plan, its inputs) and the per-row vectors."""
        num_reqs, slots, num_cached = step.num_reqs, step.slots, step.num_cached
        g = self.preset.group_size
        quantized = np.zeros(num_reqs, dtype=np.int32)
        read = quantized
        key_read = read  # values-only windows: where exact keys start
        if record is not None and record.new_rows is not None:
            real = min(record.num_reqs, num_reqs)
            added = np.flatnonzero(np.asarray(record.new_rows[:real], dtype=bool))
            self.exact_start[slots[added]] = num_cached[added] // g * g
        if step.on_device:
            # Lengths on the host are upper bounds (accepted drafts are known on the
            # GPU only): the plan is made on the device after the copy. A capture
            # (no record) has no drafts and no new rows; its device plan is all padding.
            if record is not None:
                real = min(record.num_reqs, num_reqs)
                for name, values in (("drafts", record.num_drafts), ("new_rows", record.new_rows)):
                    if values is not None:
                        StepBuffers.put(step.host, self.buffers.start(name), values[:real])
        elif record is not None or capture:
            step.plan = plan = self._plan_store(step, record)
            if record is not None:
                quantized = np.asarray(plan.quantized_lens, dtype=np.int32)
                read = np.asarray(plan.attention_lens, dtype=np.int32)
                if plan.key_read_lens is not None:
                    key_read = np.asarray(plan.key_read_lens, dtype=np.int32)
            for name in ("tiles", "writes"):
                StepBuffers.put(step.host, self.buffers.start(name), getattr(plan, name))
        sink_lens = np.zeros(num_reqs, dtype=np.int32)
        sink_slots = np.asarray(slots, dtype=np.int32)
        if self.config.sink and record is not None:
            sink_lens, sink_slots = sink_rows_for(record, slots, num_cached, g, self.max_num_reqs)
        step.quantized, step.read, step.key_read = quantized, read, key_read
        step.sink_lens, step.sink_slots = sink_lens, sink_slots
        vectors = (step.seq_lens, quantized, read, key_read, slots, sink_lens)
        for name, values in (*zip(_VECTORS, vectors), ("sink_slots", sink_slots)):
            step.host[self.buffers.start(name) :][: values.size] = values
        step.host[self.buffers.start("qsl") :][: step.qsl.size] = step.qsl

    def _plan_store(self, step: _HostStep, record: StepRecord | None) -> Any:
        """``kvarn_kernels.plan_store`` for a step (a capture's: all padding)."""
        num_reqs, g = step.num_reqs, self.preset.group_size
        zeros = np.zeros(num_reqs, np.int32)
        uniform = step.uniform_decode
        max_blocks = int(step.block_table.shape[1])
        return kernels.plan_store(
            step.num_cached if record is not None else zeros,
            step.num_new if record is not None else np.zeros(num_reqs, np.int32),
            None,
            step.slots,
            encoded_table(max_blocks, self.max_num_reqs)[:num_reqs],
            self.preset,
            staging_tiles=self.config.ring_tiles,
            query_start_loc=step.qsl,
            max_tiles=num_reqs if uniform else None,
            max_writes=num_reqs if uniform else None,
            sink=self.config.sink,
            recent_tiles=self.config.recent_tiles,
            window_keys=self.config.window_keys,
            # (never past what is cached: a row whose request was not reported
            # as added keeps a start that may be stale; the plan then stays safe)
            exact_start=np.minimum(self.exact_start[step.slots], step.num_cached // g * g)
            if record is not None
            else None,
        )

    def _split(self, step: _HostStep, record: StepRecord | None, capture: bool) -> None:
        """The step's rows by kind; in a mixed step, verify blocks as per-token decode rows."""
        num_reqs, num_new = step.num_reqs, step.num_new
        rows = np.arange(num_reqs, dtype=np.int32)
        empty = np.zeros(0, dtype=np.int32)
        if step.uniform_verify and (capture or record is not None):
            split = BatchSplit(decode=empty, fresh=empty, context=rows, uniform="context")
        elif capture or (record is not None and step.uniform_decode):
            split = BatchSplit(decode=rows, fresh=empty, context=empty, uniform="decode")
        else:
            split = split_rows(step.num_cached, num_new)
        step.split = split
        if not self.verify_rows_as_tokens or capture or step.uniform_verify:
            return
        if not split.context.size:
            return
        # Verify blocks as decode rows in a mixed step (some requests drafted fewer
        # tokens, or none, or a prompt chunk came along): the step runs outside a
        # full CUDA graph, so the short blocks join the decode rows, one decode row
        # per query token, and each layer makes one decode call over them, with the
        # per-token lengths and tables gathered here once per step instead of in
        # every layer's call. (A uniform verify step keeps its context group: a full
        # graph captures that group's per-layer gathers on the persistent buffers.)
        short = split.context[num_new[split.context] <= self.verify_limit]
        if short.size:
            joined = np.sort(np.concatenate([split.decode, short]))
            step.split = BatchSplit(
                decode=joined,
                fresh=split.fresh,
                context=np.setdiff1d(split.context, short).astype(np.int32),
                uniform=None,
            )
            step.token_rows = np.repeat(joined, num_new[joined]).astype(np.int32)

    def _group_hosts(self, step: _HostStep) -> None:
        """Each kind's rows, query starts and tokens into the host buffer (a kind that is the
        whole batch reads the step's own), and the per-token decode group's rows."""
        qsl, split, host = step.qsl, step.split, step.host
        assert split is not None
        for kind in ROW_KINDS:
            rows = getattr(split, kind)
            if not rows.size:
                continue
            starts, lens = qsl[rows], step.num_new[rows]
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
                    host[self.buffers.start(f"{kind}_{name}") :][: values.size] = values
                n_tokens = int(tokens.size)
            step.group_hosts[kind] = (
                rows,
                n_tokens,
                int(lens.max(initial=0)),
                int(step.seq_lens[rows].max(initial=0)),
                sub_qsl,
            )
        token_rows = step.token_rows
        if token_rows is None:
            return
        # How many of its block's tokens come after each of the group's tokens (which
        # the loop above wrote for its token_index).
        tokens = self.view(host, "decode_tokens", token_rows.size)
        step.token_after = after = (qsl[token_rows + 1] - 1 - tokens).astype(np.int32)
        for name, values in (("token_rows", token_rows), ("token_after", after)):
            host[self.buffers.start(name) :][: values.size] = values
        rows, _, _, _, sub_qsl = step.group_hosts["decode"]
        max_seq = int((step.seq_lens[token_rows] - after).max(initial=0))
        step.group_hosts["decode"] = (rows, int(token_rows.size), 1, max_seq, sub_qsl)

    def _used_prefix(self, step: _HostStep) -> int:
        """Where the regions this step uses end: only that much is copied."""
        assert step.split is not None
        end = self.buffers.start("new_rows") + step.num_reqs
        for kind, (_rows, n_tokens, _, _, _) in step.group_hosts.items():
            if kind != step.split.uniform:
                end = max(end, self.buffers.start(f"{kind}_tokens") + n_tokens)
        if step.token_rows is not None:
            end = max(end, self.buffers.start("token_after") + step.token_rows.size)
        return end

    def _device_plan(self, step: _HostStep, cam: Any, record: StepRecord | None, buf: Any) -> Any:
        """The step's store plan on the device buffer: the device planner's (speculative
        decoding), or the host plan's tiles with their block ids resolved; None if none."""
        if step.on_device:
            # Write rows for every token of the (padded) step: a graph replays the
            # capture's shapes, and tokens past the real ones plan nothing.
            width = max(int(step.qsl[-1]), int(cam.num_actual_tokens))
            return speculative.device_plan(self, cam, record, step.num_reqs, width, buf)
        plan = step.plan
        if plan is None:
            return None
        tiles = self.view(buf, "tiles", plan.tiles.shape[0], 5)
        writes = self.view(buf, "writes", plan.writes.shape[0], 4)
        if tiles.shape[0]:
            # Encoded (row * max_blocks + tile) -> block id, on the device.
            flat = step.block_table.reshape(-1)
            code = tiles[:, 0]
            ids = flat[code.clamp(min=0).long()].to(torch.int32)
            tiles[:, 0] = torch.where(code >= 0, ids, code)
        return self.buffers.plan_views(plan, step.num_reqs, tiles, writes)

    def _groups(self, step: _HostStep, buf: Any, v: _RowViews) -> dict[str, RowGroup | None]:
        """Each kind's :class:`RowGroup` on the device buffer."""
        groups: dict[str, RowGroup | None] = dict.fromkeys(ROW_KINDS)
        assert step.split is not None
        for kind, (rows, n_tokens, max_q, max_s, sub_qsl) in step.group_hosts.items():
            if step.split.uniform == kind:
                groups[kind] = RowGroup(
                    rows=None,
                    token_index=None,
                    query_start_loc=self.view(buf, "qsl", step.num_reqs + 1),
                    seq_lens=v.seq,
                    quantized_lens=v.read,
                    staging_slots=v.slots,
                    block_table=step.block_table,
                    max_query_len=max_q,
                    max_seq_len=max_s,
                    num_tokens=n_tokens,
                    query_start_loc_host=sub_qsl,
                    sink_lens=v.sink,
                    sink_slots=v.sink_slots,
                    key_lens=v.keys,
                )
                continue
            if kind == "decode" and step.token_rows is not None:
                whole = n_tokens == int(step.qsl[-1])
                groups[kind] = self._token_group(buf, n_tokens, max_s, step.block_table, v, whole)
                continue
            dev_rows = self.view(buf, f"{kind}_rows", rows.size).long()
            groups[kind] = RowGroup(
                rows=dev_rows,
                token_index=self.view(buf, f"{kind}_tokens", n_tokens).long(),
                query_start_loc=self.view(buf, f"{kind}_qsl", rows.size + 1),
                seq_lens=v.seq[dev_rows],
                quantized_lens=v.read[dev_rows],
                staging_slots=v.slots[dev_rows],
                block_table=step.block_table[dev_rows],
                max_query_len=max_q,
                max_seq_len=max_s,
                num_tokens=n_tokens,
                query_start_loc_host=sub_qsl,
                sink_lens=None if v.sink is None else v.sink[dev_rows],
                sink_slots=None if v.sink_slots is None else v.sink_slots[dev_rows],
                key_lens=None if v.keys is None else v.keys[dev_rows],
            )
        return groups

    def _token_group(
        self, buf: Any, n_tokens: int, max_seq: int, block_table: Any, v: _RowViews, whole: bool
    ) -> RowGroup:
        """The per-token decode group of a mixed step (:attr:`RowGroup.per_token`): the
        per-row tensors gathered for each token from the step's persistent buffers (on
        the device, after the device plan has written the lengths), each token's length
        its position + 1."""
        trow = self.view(buf, "token_rows", n_tokens).long()
        after = self.view(buf, "token_after", n_tokens)
        tables = kernels.row_tables(
            trow, block_table, v.read, v.slots, v.sink, v.sink_slots, v.keys
        )
        return RowGroup(
            rows=trow,
            token_index=None if whole else self.view(buf, "decode_tokens", n_tokens).long(),
            query_start_loc=None,
            seq_lens=v.seq.index_select(0, trow) - after,
            max_query_len=1,
            max_seq_len=max_seq,
            num_tokens=n_tokens,
            per_token=True,
            **tables._asdict(),
        )


def _attach_host(step: _HostStep, groups: dict[str, RowGroup | None]) -> None:
    """Each group's exact host lengths (the host knows them without speculative decoding)."""
    for kind, (rows, *_rest) in step.group_hosts.items():
        group = groups[kind]
        if group is None:
            continue
        if group.per_token:
            assert step.token_rows is not None and step.token_after is not None
            rows = step.token_rows
            seq_lens = step.seq_lens[rows] - step.token_after
        else:
            seq_lens = step.seq_lens[rows]
        assert step.read is not None and step.sink_lens is not None
        assert step.sink_slots is not None and step.key_read is not None
        group.host = {
            "seq_lens": seq_lens,
            "quantized_lens": step.read[rows],
            "sink_lens": step.sink_lens[rows],
            "sink_slots": step.sink_slots[rows],
            "staging_slots": step.slots[rows],
            "key_lens": step.key_read[rows],
        }
