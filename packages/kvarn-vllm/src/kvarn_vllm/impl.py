"""The attention implementation of one layer: store, then attend, per kind of row.

This module subclasses vLLM's ``AttentionImpl``, so it imports vLLM; the backend class
names it (``get_impl_cls``) only when vLLM asks. Where the modes differ on purpose (the
docs say so too):

* a prompt's first chunk (nothing cached) attends its own K/V **exactly**
  (:mod:`kvarn_vllm.prefill`), as the published fork does;
* every other query reads the cache as this step's store left it: complete tiles
  quantized, the open tile (and the recent ones) from staging (exact, rotated frame), and its
  own step's tokens exact from the step's K/V. So a chunked-prefill continuation or a
  prefix-cache hit sees quantized tiles where an unchunked prefill of the same prompt saw
  exact K/V, but never its own tokens quantized (except in batch-invariant mode, where the
  multi-query kernel reads them as decoding does, so that a verify row's bits equal decode's).
  A continuation chunk of 64+ tokens goes through the dense-context path
  (:mod:`kvarn_vllm.dense`); short continuations through the multi-query kernel.

Staging for the open tiles is allocated here, in ``__init__`` (:mod:`kvarn_vllm.staging`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from kvarn_vllm import compat, dense, groups, kernels, overflow, staging
from kvarn_vllm.config import parse_kv_cache_dtype
from kvarn_vllm.groups import group_rows, query_runs, row_expansion, write_group_rows
from kvarn_vllm.prefill import fresh_attention
from kvarn_vllm.step import STEP

__all__ = ["KvarnAttentionImpl"]


def _unsupported(alibi_slopes, logits_soft_cap, attn_type, extra: dict[str, Any]) -> list[str]:
    """What of a layer's settings kvarn does not serve (empty when it serves them all)."""
    unsupported = []
    if alibi_slopes is not None:
        unsupported.append("ALiBi slopes")
    if logits_soft_cap:
        unsupported.append(f"logits soft-capping ({logits_soft_cap})")
    if attn_type != AttentionType.DECODER:
        unsupported.append(f"attention type {attn_type!r}")
    if extra.get("sinks") is not None:
        unsupported.append("attention sinks")
    return unsupported


class KvarnAttentionImpl(AttentionImpl):
    """Dense/GQA attention over a KVarN cache for one layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        vllm_config = get_current_vllm_config()
        spec = vllm_config.speculative_config
        self.config = parse_kv_cache_dtype(
            kv_cache_dtype,
            num_speculative_tokens=getattr(spec, "num_speculative_tokens", None),
        )
        self.preset = self.config.preset
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        unsupported = _unsupported(alibi_slopes, logits_soft_cap, attn_type, extra)
        if unsupported:
            layer = compat.calling_layer_name() or "<unknown layer>"
            raise ValueError(
                f"kvarn-vllm cannot serve attention layer {layer!r} with kv_cache_dtype="
                f"{kv_cache_dtype}: it uses {', '.join(unsupported)}. To serve this model, "
                "use kv_cache_dtype auto or fp8."
            )
        self.config.check_head_dim(head_size)
        self.staging = None
        self.frame_queries = None
        self.overflow_count = None  # int32 [1]: tiles this layer's stores saturated
        if kv_sharing_target_layer_name is not None:
            staging.count_shared_layer()  # attends without K/V of its own
        else:
            self.overflow_count = overflow.COUNTERS.allocate(
                compat.calling_layer_name(), torch.get_default_device()
            )
            model = vllm_config.model_config
            dtype = model.dtype if model else torch.get_default_dtype()
            # Model build runs under `with torch.device(target)`: this lands on the GPU.
            self.staging, self.frame_queries = staging.allocate_layer_staging(
                self.config,
                int(vllm_config.scheduler_config.max_num_seqs),
                self.num_heads,
                self.num_kv_heads,
                head_size,
                dtype,
                torch.get_default_device(),
            )
        self.workspace = None
        if dense.dense_context_enabled():
            self.workspace = dense.dense_workspace(
                self.num_kv_heads, head_size, vllm_config, torch.get_default_device()
            )
        self._reader = dense.ContextReader.of(self.config, head_size)

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
    ):
        """Store this step's K/V (``[T, Hkv, D]``) into the cache, then attend each kind of
        row: queries ``[T, Hq, D]``, written into ``output`` ``[T, Hq, D]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by kvarn-vllm")
        assert output is not None, "kvarn-vllm writes into vLLM's output buffer"
        if attn_metadata is None:
            return output.fill_(0)  # profiling run without metadata
        kv_cache = compat.cache_records(kv_cache)  # vLLM 0.29+: [B, H, 1, C] view
        md = attn_metadata
        n = md.num_actual_tokens
        stage = self._staging(layer)
        if md.plan is not None and key is not None and value is not None:
            auto = self.config.mixed_key_frames
            kernels.store_kv(
                key[:n],
                value[:n],
                kv_cache,
                stage,
                md.plan,
                self.preset,
                key_frame=self.config.key_frame,
                query=query[:n] if auto else None,
                frame_queries=self.frame_queries,
                overflow_count=self.overflow_count,
            )
        if md.decode is not None:
            self._decode(md, query, kv_cache, stage, output)
        if md.fresh is not None:
            self._fresh(md.fresh, query, key, value, output, n)
        if md.context is not None:
            self._context(md, query, key, value, kv_cache, stage, output, n)
        return output

    def _decode(self, md, query, kv_cache, stage, output):
        """The decode rows: one ``decode_attention`` call. The whole batch writes its output
        in place; gathered rows are scattered back. A per-token group (verify blocks as
        decode rows) has a row per query token."""
        g = md.decode
        whole = g.token_index is None
        m = g.num_tokens if g.per_token else md.num_reqs
        res = self._plan(g, md).run(
            query[:m] if whole else query.index_select(0, g.token_index),
            kv_cache,
            stage,
            out=output[:m] if whole else None,
        )
        if not whole:
            output.index_copy_(0, g.token_index, res)

    def _plan(self, g, md, several=False):
        """The step's attention plan for row group ``g`` (:func:`kvarn_kernels.plan_attention`):
        made by the first layer that runs the group, then run by every layer of the step.
        ``several``: rows of several query tokens (the multi-query kernel), else one per row.
        Splits are sized for the step (``split_batch``), not the group's rows, so that a
        verify row run as a decode row splits as a decode would."""
        key = (several, self.scale, self.sliding_window)
        plan = g.plans.get(key)
        if plan is None:
            plan = kernels.plan_attention(
                g.block_table,
                g.seq_lens,
                g.quantized_lens,
                g.staging_slots,
                self.preset,
                self.scale,
                query_start_loc=g.query_start_loc if several else None,
                max_query_len=g.max_query_len if several else None,
                sliding_window=self.sliding_window,
                sink_lens=g.sink_lens,
                sink_slots=g.sink_slots,
                batch_invariant=self.config.batch_invariant,
                raw_keys=self.config.mixed_key_frames,
                key_lens=g.key_lens,
                key_tiles=self.config.key_tiles,
                split_batch=md.num_reqs,
            )
            g.plans[key] = plan
        return plan

    def _context(self, md, query, key, value, kv_cache, stage, output, n):
        """The context rows: the dense path, runs of verify blocks and chunks (batch-invariant
        mode), decode rows (verify blocks, a drafter's non-causal block) or one multi-query
        call."""
        g = md.context
        runs = self._verify_runs(g)
        if md.causal and dense.use_dense_context(g, self.workspace):
            self._context_dense(g, query, key, value, kv_cache, stage, output, n)
            return
        if runs is not None:
            self._context_runs(g, runs, query, kv_cache, stage, output, n, md.causal)
            return
        q = group_rows(g, query, n)
        # A non-causal block (a drafter's) reads its own tokens from staging, where
        # the store put them: the kernel attends each row's whole sequence.
        if self._verify_as_decode(g) or not md.causal:
            res = self._decode_rows(g, q, kv_cache, stage, output, n, md)
            if g.token_index is not None:
                output.index_copy_(0, g.token_index, res)
            return
        own = None if self.config.batch_invariant else self._own_kv(g, key, value, n)
        res = self._plan(g, md, several=True).run(
            q, kv_cache, stage, out=output[:n] if g.token_index is None else None, fresh_kv=own
        )
        if g.token_index is not None:
            output.index_copy_(0, g.token_index, res)

    def _decode_rows(self, g, q, kv_cache, stage, output, n, md):
        """A context group's query tokens as decode rows, one per token: verify blocks in
        the default launch (``KVARN_VLLM_VERIFY_AS_DECODE``), or a drafter's non-causal
        block, whose rows each attend the whole sequence. The same computation as
        ``multi_query_attention``'s decode-row path, with the per-row lengths and tables
        (:func:`~kvarn_vllm.groups.row_expansion`) computed by the step's first layer and
        reused by the others. The whole batch's output is written in place, padding rows past
        the last query left as they were; a gathered group's result is returned."""
        whole = g.token_index is None
        e = row_expansion(g, q.shape[0], md.causal)
        # Written in place where every row is a query (outside a CUDA graph capture,
        # whose replays may bring padding rows); else masked below.
        direct = whole and n == g.num_tokens and not groups.capturing()
        res = kernels.decode_attention(
            q,
            kv_cache,
            stage,
            e["block_table"],
            e["row_lens"],
            e["quantized_lens"],
            e["staging_slots"],
            self.preset,
            self.scale,
            sliding_window=self.sliding_window,
            sink_lens=e["sink_lens"],
            sink_slots=e["sink_slots"],
            batch_invariant=self.config.batch_invariant,
            raw_keys=self.config.mixed_key_frames,
            key_lens=e["key_lens"],
            key_tiles=self.config.key_tiles,
            split_batch=md.num_reqs,
            out=output[:n] if direct else None,
        )
        if not whole or direct:
            return res
        out = output[:n]
        out.copy_(torch.where(e["valid"], res, out))
        return out

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """A DFlash drafter's context store: K/V (original frame, ``[T, H, D]``) of every
        token the target step scheduled, in its order, written outside any forward
        (``precompute_and_store_context_kv``). kvarn stores them with the target step's
        plan for this layer (``slot_mapping`` names the same positions): tokens that can
        no longer be rejected are committed, the rest staged, as the target's own layers
        did. The drafter computes no queries for these tokens, so every tile it completes
        keeps its keys rotated (attention reads each tile's key frame)."""
        by_layer = STEP.target_metadata
        if by_layer is None:
            raise RuntimeError(
                f"kvarn-vllm: do_kv_cache_update on layer {layer.layer_name!r} outside a "
                "DFlash proposal: kvarn stores K/V inside forward, and a drafter's context "
                "with the target step's plan (kvarn_vllm.step.STEP.proposing)"
            )
        md = by_layer.get(layer.layer_name)
        if md is None:
            raise RuntimeError(
                f"kvarn-vllm: the target step built no metadata for layer "
                f"{layer.layer_name!r}, so its context K/V cannot be stored"
            )
        if md.plan is None:  # a dummy (profiling, warm-up) step: nothing is written
            return
        kv_cache = compat.cache_records(kv_cache)
        if key.shape[0] > md.num_actual_tokens:
            raise ValueError(
                f"kvarn-vllm: layer {layer.layer_name!r}: {key.shape[0]} context tokens "
                f"for a target step of {md.num_actual_tokens}"
            )
        kernels.store_kv(
            key,
            value,
            kv_cache,
            self._staging(layer),
            md.plan,
            self.preset,
            key_frame="rotated",
            overflow_count=self.overflow_count,
        )

    def _staging(self, layer):
        """This layer's staging, or for a layer that shares an earlier layer's KV cache,
        that layer's."""
        if self.staging is not None:
            return self.staging
        return compat.forward_context_layer(layer.kv_sharing_target_layer_name).impl.staging

    def _own_kv(self, g, key, value, n):
        """The context rows' own K/V from this step, rotated (what staging would hold):
        a chunk attends its own tokens exact even where its store completed their tiles.
        ``None`` for a KV-sharing layer (no K/V of its own: everything from the cache).
        The multi-query kernel does not get them in batch-invariant mode: there it reads
        a row's own tokens from the cache, step for step as the decode kernel does."""
        if key is None or value is None:
            return None
        return kernels.rotate(group_rows(g, key, n)), kernels.rotate(group_rows(g, value, n))

    def _verify_as_decode(self, g):
        """Verify blocks as decode rows (``KVARN_VLLM_VERIFY_AS_DECODE``, on by default under
        speculative decoding) in the default launch: a context group of
        verify blocks only (at most ``VERIFY_AS_DECODE_MAX_QUERY`` tokens per row) goes to
        the kernels as decode rows, reading its own tokens from staging as the decode
        kernel does (no ``fresh_kv``)."""
        return (
            self.config.verify_as_decode
            and not self.config.batch_invariant
            and g.max_query_len <= kernels.verify_as_decode_max_query()
        )

    def _verify_runs(self, g):
        """Batch-invariant mode: a context group with rows of at most
        ``VERIFY_AS_DECODE_MAX_QUERY`` query tokens (verify blocks) and longer ones
        (chunks): the runs of rows of each kind, so that the short ones may run as decode
        rows (:func:`kvarn_kernels.attention.launch.verify_as_decode`) whatever else the
        step holds; else None (one multi-query call). In the default launch a mixed
        step's verify blocks are decode rows of their own group already
        (:attr:`kvarn_vllm.metadata.RowGroup.per_token`)."""
        if not self.config.batch_invariant:
            return None
        limit = kernels.verify_as_decode_max_query()
        if g.max_query_len <= limit:
            return None
        runs = query_runs(g.query_start_loc_host, limit)
        return runs if len(runs) > 1 else None

    def _context_runs(self, g, runs, query, kv_cache, stage, output, n, causal):
        """A batch-invariant context group in ``runs`` of verify blocks and of longer
        chunks (:meth:`_verify_runs`), each through :meth:`_context_mqa`, every run
        reading its own tokens from the cache."""
        q = group_rows(g, query, n)
        res = torch.empty_like(q)
        qs = [int(x) for x in g.query_start_loc_host]
        for lo, hi in runs:
            a, b = qs[lo], qs[hi]
            self._context_mqa(g, q[a:b], kv_cache, stage, lo, hi, res[a:b], None, causal)
        write_group_rows(g, output, res, n)

    def _context_dense(self, g, query, key, value, kv_cache, stage, output, n):
        """Chunks after cached tokens through dense attention (:mod:`kvarn_vllm.dense`): rows
        are taken in runs whose contexts fit the workspace together; each row's context is
        written into it (:meth:`~kvarn_vllm.dense.ContextReader.fill_row`), then
        FlashAttention's varlen kernel attends them with the rotated queries. A
        sliding-window layer takes only the tiles some query of the row can see. A row whose
        context alone exceeds the workspace goes through the multi-query kernel, which reads
        the chunk's own tokens exact the same way. The host knows every length (no
        speculative decoding), so the batching is a loop over rows on the host."""
        h = g.host
        q = group_rows(g, query, n)
        own = self._own_kv(g, key, value, n)  # a KV-sharing layer has none: staging
        res = torch.empty_like(q)
        ws = self.workspace
        qs = [int(x) for x in g.query_start_loc_host]
        gsize = self.preset.group_size
        firsts, lens = dense.first_positions(h, qs, self.sliding_window, gsize)
        for lo, hi in dense.dense_runs(lens, ws.shape[1]):
            q_lo, q_hi = qs[lo], qs[hi]
            if lens[lo] > ws.shape[1]:  # one row, too long to dequantize
                own_rows = None
                if own is not None and not self.config.batch_invariant:
                    own_rows = (own[0][q_lo:q_hi], own[1][q_lo:q_hi])
                self._context_mqa(
                    g, q[q_lo:q_hi], kv_cache, stage, lo, hi, res[q_lo:q_hi], own_rows
                )
                continue
            off = 0
            for i in range(lo, hi):
                row = {
                    "seq_len": int(h["seq_lens"][i]),
                    "quant": int(h["quantized_lens"][i]),
                    "key_len": int(h["key_lens"][i]),
                    "slot": int(h["staging_slots"][i]),
                    "sink_len": int(h["sink_lens"][i]),
                    "sink_slot": int(h["sink_slots"][i]),
                    "first": firsts[i],
                    "num_queries": qs[i + 1] - qs[i],
                }
                own_row = (
                    None if own is None else (own[0][qs[i] : qs[i + 1]], own[1][qs[i] : qs[i + 1]])
                )
                off += self._reader.fill_row(
                    ws, off, row, g.block_table[i], kv_cache, stage, own_row
                )
            res[q_lo:q_hi] = dense.attend_dense(
                q[q_lo:q_hi],
                ws,
                off,
                g.query_start_loc[lo : hi + 1] - g.query_start_loc[lo],
                [x - q_lo for x in qs[lo : hi + 1]],
                lens[lo:hi],
                self.scale,
                self.sliding_window,
                self.head_size,
            )
        write_group_rows(g, output, res, n)

    def _context_mqa(self, g, q, kv_cache, stage, lo, hi, out, own, causal=True):
        """Rows ``lo:hi`` of a context group through the multi-query kernel (``own``: their
        tokens' K/V from this step, rotated; ``causal=False``: each row's tokens attend its
        whole sequence)."""
        qs = g.query_start_loc_host
        max_query_len = int(max(int(qs[i + 1]) - int(qs[i]) for i in range(lo, hi)))
        kernels.multi_query_attention(
            q,
            g.query_start_loc[lo : hi + 1] - g.query_start_loc[lo],
            kv_cache,
            stage,
            g.block_table[lo:hi],
            g.seq_lens[lo:hi],
            g.quantized_lens[lo:hi],
            g.staging_slots[lo:hi],
            self.preset,
            self.scale,
            sliding_window=self.sliding_window,
            max_query_len=max_query_len,
            out=out,
            sink_lens=None if g.sink_lens is None else g.sink_lens[lo:hi],
            sink_slots=None if g.sink_slots is None else g.sink_slots[lo:hi],
            batch_invariant=self.config.batch_invariant,
            fresh_kv=own,
            raw_keys=self.config.mixed_key_frames,
            key_lens=None if g.key_lens is None else g.key_lens[lo:hi],
            key_tiles=self.config.key_tiles,
            causal=causal,
        )

    def _fresh(self, g, query, key, value, output, n):
        """Exact causal attention of a first chunk over its own K/V (original frame)."""
        if key is None or value is None:
            raise ValueError(
                "a KV-sharing layer cannot run a prompt's first chunk: it has no K/V of its own"
            )
        whole = g.token_index is None
        if whole:
            q, k, v, o = query[:n], key[:n], value[:n], output[:n]
        else:
            idx = g.token_index
            q, k, v = (t.index_select(0, idx) for t in (query, key, value))
            o = torch.empty_like(q)
        fresh_attention(g, q, k, v, o, self.scale, self.sliding_window, self.head_size)
        if not whole:
            output.index_copy_(0, g.token_index, o)
