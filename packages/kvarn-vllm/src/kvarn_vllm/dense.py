"""The dense-context path: continuation chunks attend their dequantized context with
FlashAttention.

A chunk after cached tokens (64+ query tokens, the host knowing every length: no speculative
decoding) dequantizes its row's cache once into a preallocated workspace, in the model dtype
and the rotated frame, and runs FlashAttention's varlen kernel over it
(``KVARN_VLLM_DENSE_CONTEXT=0`` turns it off). Rows whose context does not fit the workspace
go through the multi-query kernel, as short continuations do.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from kvarn_vllm import kernels
from kvarn_vllm.config import KvarnConfig, env_flag
from kvarn_vllm.prefill import exact_causal_attention, flash_prefill

__all__ = [
    "DENSE_CONTEXT_ENV",
    "ContextReader",
    "dense_context_enabled",
    "dense_runs",
    "dense_workspace",
    "first_positions",
    "use_dense_context",
]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

DENSE_CONTEXT_ENV = "KVARN_VLLM_DENSE_CONTEXT"
DENSE_CONTEXT_MIN_QUERY = 64


DENSE_CONTEXT_WORKSPACE_BYTES = 256 * 2**20
_WORKSPACES: dict[tuple[Any, ...], Any] = {}


def dense_context_enabled() -> bool:
    """``KVARN_VLLM_DENSE_CONTEXT`` (default ``1``; ``0`` sends every continuation chunk
    through the multi-query kernel)."""
    return env_flag(DENSE_CONTEXT_ENV, True)


def use_dense_context(group: Any, workspace: Any) -> bool:
    """Whether a context group goes through :func:`attend_dense`: only with a workspace
    (``KVARN_VLLM_DENSE_CONTEXT`` on), when the host knows the rows' lengths exactly (no
    speculative decoding) and some row brings at least ``DENSE_CONTEXT_MIN_QUERY`` query
    tokens (a chunked-prefill continuation, not a verify)."""
    if workspace is None:
        return False
    return group.host is not None and group.max_query_len >= DENSE_CONTEXT_MIN_QUERY


def dense_runs(seq_lens: Any, capacity: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[lo, hi)`` whose context lengths sum to at most
    ``capacity`` tokens; a row longer than ``capacity`` is a range of its own (the caller
    sends it to the multi-query kernel)."""
    runs: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, length in enumerate(int(x) for x in seq_lens):
        if i > lo and total + length > capacity:
            runs.append((lo, i))
            lo, total = i, 0
        total += length
        if length > capacity:
            runs.append((lo, i + 1))
            lo, total = i + 1, 0
    if lo < len(seq_lens):
        runs.append((lo, len(seq_lens)))
    return runs


def dense_workspace(num_kv_heads: int, head_size: int, vllm_config: Any, device: Any) -> Any:
    """The dense-context workspace ``[2, T, num_kv_heads, head_size]`` (model dtype), one per
    process and shape, shared by the layers (they run one after another). Allocated at model
    build, like staging, so vLLM's memory profiling counts it. ``T`` is the most tokens
    that fit ``DENSE_CONTEXT_WORKSPACE_BYTES``, a multiple of 128, at most 4 x max_model_len."""
    import torch

    model = vllm_config.model_config
    dtype = model.dtype if model is not None else torch.get_default_dtype()
    per_token = 2 * num_kv_heads * head_size * dtype.itemsize
    source = model if model is not None else vllm_config.scheduler_config
    max_len = int(getattr(source, "max_model_len", 0) or 0)
    tokens = DENSE_CONTEXT_WORKSPACE_BYTES // per_token // 128 * 128
    if max_len:
        tokens = min(tokens, -(-4 * max_len // 128) * 128)
    tokens = max(tokens, 128)
    key = (str(device), dtype, num_kv_heads, head_size)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(
            (2, tokens, num_kv_heads, head_size), dtype=dtype, device=device
        )
        logger.info(
            "kvarn: dense-context workspace: %d tokens x %d KV heads x %d dims, %.0f MiB "
            "(continuation chunks attend their dequantized context with FlashAttention; a "
            "row with a longer context uses the multi-query kernel; %s=0 turns it off)",
            tokens,
            num_kv_heads,
            head_size,
            tokens * per_token / 2**20,
            DENSE_CONTEXT_ENV,
        )
    return _WORKSPACES[key]


def first_positions(
    host: dict[str, Any], qs: list[int], window: int | None, group_size: int
) -> tuple[list[int], list[int]]:
    """Per row of a context group, the first position some query sees, rounded down to a
    tile (keys ``[first, seq_len)`` go to the workspace: FlashAttention aligns queries to the
    end), and how many positions that is. ``host``: the group's host lengths; ``qs``: its
    host query starts."""
    firsts = []
    for i, seq_len in enumerate(int(x) for x in host["seq_lens"]):
        start = seq_len - (qs[i + 1] - qs[i])
        firsts.append(
            0 if window is None else max(0, start - window + 1) // group_size * group_size
        )
    lens = [int(x) - f for x, f in zip(host["seq_lens"], firsts, strict=True)]
    return firsts, lens


@dataclass(frozen=True)
class ContextReader:
    """How a layer's cached context is laid out: its preset's records, and its staging ring
    (``ring`` tokens after ``base`` sink rows; ``key_ring`` tokens of keys when values-only
    windows keep their keys apart, else None).

    Build it with :meth:`of`.
    """

    preset: Any
    head_size: int
    ring: int
    base: int
    key_ring: int | None

    @classmethod
    def of(cls, config: KvarnConfig, head_size: int) -> ContextReader:
        g = config.preset.group_size
        key_ring = None if config.key_tiles is None else config.key_tiles * g
        return cls(config.preset, head_size, config.ring_tokens, config.sink_rows, key_ring)

    def halves(self, staging: Any, slot: int) -> tuple[Any, Any]:
        """A slot's staged keys and values, ``[rows, H, D]`` each."""
        st = staging[slot]
        kring = self.key_ring
        return (st[0], st[1]) if kring is None else (st[:kring], st[kring:])

    def fill_row(
        self,
        ws: Any,
        off: int,
        row: dict[str, int],
        block_row: Any,
        kv_cache: Any,
        staging: Any,
        own: tuple[Any, Any] | None,
    ) -> int:
        """Write one row's context ``[first, seq_len)`` into the workspace ``ws``
        (``[2, T, H, D]``, model dtype, rotated frame) from entry ``off`` on; returns how many
        entries it wrote.

        The cached tokens are dequantized from their records (tile 0 from the sink rows where
        the row keeps it exact, recent and open tiles from staging; with values-only windows
        only their values, the keys of the tiles before ``key_lens`` from the records), the
        chunk's own tokens exact from this step's K/V ``own`` (as a first chunk attends them,
        and as decoding would: a query never reads its own tile quantized). ``row``: its
        ``seq_len``, ``quant`` (quantized_lens), ``key_len``, ``slot``, ``sink_len``,
        ``sink_slot``, ``first`` and ``num_queries``; ``block_row``: its block table row.
        """
        import torch

        gsize = self.preset.group_size
        seq_len, first = row["seq_len"], row["first"]
        # This step's tokens [fresh, seq_len) come exact from the batch.
        fresh = seq_len - row["num_queries"] if own is not None else seq_len
        quant = min(row["quant"], fresh)  # value records below, exact at and above
        # Keys as the kernels read them: from records below max(quant, key_lens)
        # (key_lens: values-only windows), from their ring above; tile 0's keys
        # from the ring too while it is the step's own tile (key_lens < G).
        kq = quant if self.key_ring is None else min(row["key_len"], fresh)
        rec_end = max(quant, kq)
        stage_k, stage_v = self.halves(staging, row["slot"])
        if rec_end > first:
            # Whole tiles (the one holding `fresh` is complete when quant > fresh
            # would have been: it has a record); exact rows overwrite the rest.
            end = -(-rec_end // gsize) * gsize
            blocks = block_row[first // gsize : end // gsize].contiguous()
            n_q = end - first
            kernels.dequantize(
                kv_cache,
                blocks,
                self.preset,
                self.head_size,
                dtype=ws.dtype,
                out=(ws[0, off : off + n_q], ws[1, off : off + n_q]),
            )
            if first == 0 and quant >= gsize and row["sink_len"] and self.base:
                sink_k, sink_v = self.halves(staging, row["sink_slot"])
                ws[1, off : off + gsize] = sink_v[:gsize]
                if self.key_ring is None:
                    ws[0, off : off + gsize] = sink_k[:gsize]
                elif kq < gsize:
                    ws[0, off : off + gsize] = stage_k[:gsize]  # p % kring = p
        # positions from max(quant, first) (values), max(rec_end, first) (keys) on
        for part, start, rows_of, src in (
            (1, max(quant, first), None, stage_v),
            (0, max(rec_end, first), self.key_ring, stage_k),
        ):
            pos = torch.arange(start, fresh, device=ws.device)
            rows = (
                kernels.staging_rows(pos, self.ring, self.base)
                if rows_of is None
                else pos % rows_of
            )
            ws[part, off + start - first : off + fresh - first] = src.index_select(0, rows)
        if fresh < seq_len:
            assert own is not None
            a, b = off + fresh - first, off + seq_len - first
            ws[0, a:b] = own[0]
            ws[1, a:b] = own[1]
        return seq_len - first


def attend_dense(
    q: Any,
    ws: Any,
    used: int,
    query_start_loc: Any,
    qs: list[int],
    kv_lens: list[int],
    scale: float,
    window: int | None,
    head_size: int,
) -> Any:
    """Causal attention of the rows' queries ``q`` (``[t, Hq, D]``, original frame) over
    their contexts, laid one after another in the first ``used`` entries of ``ws``;
    ``query_start_loc`` (device) and ``qs`` (host) are the rows' query starts from 0,
    ``kv_lens`` their context lengths. Returns ``[t, Hq, D]`` in the original frame."""
    import torch

    lens = torch.as_tensor(kv_lens, dtype=torch.int32)
    cu_k = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu_k[1:])
    q_rot = kernels.rotate(q)
    o_rot = torch.empty_like(q_rot)
    flash = flash_prefill(head_size)
    if flash is not None:
        flash_fn, fa_version = flash
        flash_fn(
            q_rot,
            ws[0, :used],
            ws[1, :used],
            max_seqlen_q=max(b - a for a, b in itertools.pairwise(qs)),
            cu_seqlens_q=query_start_loc,
            max_seqlen_k=int(lens.max()),
            cu_seqlens_k=cu_k.to(q.device),
            softmax_scale=scale,
            causal=True,
            window_size=None if window is None else [window - 1, 0],
            out=o_rot,
            fa_version=fa_version,
        )
    else:
        exact_causal_attention(
            q_rot, ws[0, :used], ws[1, :used], o_rot, qs, scale, window, kv_start_loc=cu_k.tolist()
        )
    return kernels.unrotate(o_rot)
