"""Attention as plan and run: the step's metadata once, then one call per layer.

:func:`decode_attention` and :func:`multi_query_attention` take the step's metadata (block
table, lengths, staging slots, sink and key windows, split sizing) on every call, and every
layer of a step passes the same. :func:`plan_attention` checks and keeps it once per step
(and per kind of row); :meth:`AttentionPlan.run` is the per-layer call, with only what
changes per layer: the queries, the layer's cache and staging, and optionally its output and
its own K/V. It computes exactly what the two functions compute (it calls them). As
FlashInfer's wrappers split ``plan()`` per batch from ``run()`` per layer.

A custom engine's decode loop::

    plan = plan_attention(block_table, seq_lens, quantized_lens, staging_slots, preset,
                          scale=head_dim**-0.5)
    for layer in layers:
        q, k, v = layer.qkv(hidden)
        store_kv(k, v, layer.kv_cache, layer.staging, store_plan, preset)
        out = plan.run(q, layer.kv_cache, layer.staging)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvarn_math.layout import Preset, get_preset

from kvarn_kernels.attention.launch import decode_attention, multi_query_attention

__all__ = ["AttentionPlan", "plan_attention"]


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention metadata for every layer of a KV cache group.

    Built by :func:`plan_attention`; the fields are :func:`decode_attention`'s and
    :func:`multi_query_attention`'s arguments of the same names. ``query_start_loc`` None:
    one query token per sequence (decode rows); else several (``max_query_len`` known on the
    host, so no layer synchronizes with the device).
    """

    preset: Preset
    scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    quantized_lens: torch.Tensor
    staging_slots: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    max_query_len: int | None = None
    sliding_window: int | None = None
    num_splits: int | None = None
    sink_lens: torch.Tensor | None = None
    sink_slots: torch.Tensor | None = None
    batch_invariant: bool | None = None
    raw_keys: bool = True
    key_lens: torch.Tensor | None = None
    key_tiles: int | None = None
    causal: bool = True
    verify_as_decode: bool | None = None
    split_batch: int | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return int(self.seq_lens.shape[0])

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        staging: torch.Tensor,
        out: torch.Tensor | None = None,
        fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One layer's attention over its cache.

        Args:
            query: ``[B, Hq, D]`` (decode) or ``[num_q_tokens, Hq, D]`` (several query tokens
                per sequence), original frame.
            kv_cache: the layer's uint8 ``[num_blocks, Hkv, tile_bytes]`` records.
            staging: the layer's staging (:func:`kvarn_kernels.allocate_staging`).
            out: optional output, ``query``'s shape and dtype.
            fresh_kv: several query tokens only: the queries' own K/V, rotated (as
                :func:`multi_query_attention`).

        Returns:
            The attention output, ``query``'s shape and dtype, original frame.

        Raises:
            ValueError: ``fresh_kv`` for a decode plan, or what the kernels' checks raise.
        """
        common: dict[str, Any] = {
            "sliding_window": self.sliding_window,
            "out": out,
            "num_splits": self.num_splits,
            "sink_lens": self.sink_lens,
            "sink_slots": self.sink_slots,
            "batch_invariant": self.batch_invariant,
            "raw_keys": self.raw_keys,
            "key_lens": self.key_lens,
            "key_tiles": self.key_tiles,
            "split_batch": self.split_batch,
        }
        tables = (self.block_table, self.seq_lens, self.quantized_lens, self.staging_slots)
        if self.query_start_loc is None:
            if fresh_kv is not None:
                raise ValueError(
                    "fresh_kv is for plans of several query tokens per sequence "
                    "(plan_attention(query_start_loc=...)); this plan decodes one per sequence"
                )
            return decode_attention(
                query, kv_cache, staging, *tables, self.preset, self.scale, **common
            )
        return multi_query_attention(
            query,
            self.query_start_loc,
            kv_cache,
            staging,
            *tables,
            self.preset,
            self.scale,
            max_query_len=self.max_query_len,
            fresh_kv=fresh_kv,
            causal=self.causal,
            verify_as_decode=self.verify_as_decode,
            **common,
        )


def _check_rows(name: str, t: torch.Tensor | None, num_seqs: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.ndim != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor [{num_seqs}], got {got}")
    if t.shape[0] != num_seqs:
        raise ValueError(
            f"{name} must have {num_seqs} entries (one per sequence), got {t.shape[0]}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (as seq_lens), got {t.device}")


def plan_attention(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    preset: str | Preset,
    scale: float,
    *,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    sink_lens: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    raw_keys: bool = True,
    key_lens: torch.Tensor | None = None,
    key_tiles: int | None = None,
    causal: bool = True,
    verify_as_decode: bool | None = None,
    split_batch: int | None = None,
) -> AttentionPlan:
    """A step's :class:`AttentionPlan` (once per step and kind of row, for every layer).

    Arguments as :func:`decode_attention` (and :func:`multi_query_attention` with
    ``query_start_loc``: int32 ``[B + 1]``). Without ``max_query_len`` a multi-query plan reads
    it from ``query_start_loc`` here, once per step, rather than in every layer.

    Raises:
        ValueError: per-sequence tensors that are not int32 ``[B]`` on ``seq_lens``' device,
            a ``block_table`` that is not int32 ``[B, max_blocks]``, or a ``query_start_loc``
            that is not int32 ``[B + 1]``.
    """
    p = get_preset(preset)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.ndim != 1:
        raise ValueError(f"seq_lens must be an int32 tensor [B], got {seq_lens!r}")
    num_seqs, device = int(seq_lens.shape[0]), seq_lens.device
    for name, t in (
        ("seq_lens", seq_lens),
        ("quantized_lens", quantized_lens),
        ("staging_slots", staging_slots),
        ("sink_lens", sink_lens),
        ("sink_slots", sink_slots),
        ("key_lens", key_lens),
    ):
        _check_rows(name, t, num_seqs, device)
    if (
        block_table.dtype != torch.int32
        or block_table.ndim != 2
        or block_table.shape[0] != num_seqs
    ):
        raise ValueError(
            f"block_table must be int32 [{num_seqs}, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if query_start_loc is not None:
        if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
            raise ValueError(
                f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} "
                f"{tuple(query_start_loc.shape)}"
            )
        if max_query_len is None:
            lens = query_start_loc[1:] - query_start_loc[:-1]
            max_query_len = int(lens.max()) if num_seqs else 0
    return AttentionPlan(
        preset=p,
        scale=float(scale),
        block_table=block_table,
        seq_lens=seq_lens,
        quantized_lens=quantized_lens,
        staging_slots=staging_slots,
        query_start_loc=query_start_loc,
        max_query_len=max_query_len,
        sliding_window=sliding_window,
        num_splits=num_splits,
        sink_lens=sink_lens,
        sink_slots=sink_slots,
        batch_invariant=batch_invariant,
        raw_keys=raw_keys,
        key_lens=key_lens,
        key_tiles=key_tiles,
        causal=causal,
        verify_as_decode=verify_as_decode,
        split_batch=split_batch,
    )
