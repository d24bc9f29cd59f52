"""The attention implementation of one layer: store, then attend, per kind of row.

Where the modes differ on purpose (the docs say so too):

* a prompt's first chunk (nothing cached) attends its own K/V **exactly** (vLLM's
  FlashAttention when installed, else its Triton varlen kernel), as the published fork does;
* every other query reads the cache as this step's store left it: complete tiles
  quantized, the open tile (and the recent ones) from staging (exact, rotated frame), and its
  own step's tokens exact from the step's K/V. So a chunked-prefill continuation or a
  prefix-cache hit sees quantized tiles where an unchunked prefill of the same prompt saw
  exact K/V, but never its own tokens quantized (except in batch-invariant mode, where the
  multi-query kernel reads them as decoding does, so that a verify row's bits equal decode's).
  A continuation chunk of 64+ tokens dequantizes its row's cache once into a preallocated
  workspace and runs FlashAttention over it (the default, ``KVARN_VLLM_DENSE_CONTEXT=0``
  turns it off); rows whose context does not fit the workspace, and short continuations, go
  through the multi-query kernel.

Staging for the open tiles (``[num_slots, 2, S*G, num_kv_heads, head_dim]``, model dtype)
is allocated here, in ``__init__``: vLLM builds the model before it profiles memory, so
the staging is counted as model memory and the KV cache is sized from what is left.
``num_slots`` is ``max_num_seqs``: every running request owns a slot and concurrency is
never capped below what the user asked for.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from kvarn_math.layout import tile_layout

from kvarn_vllm import compat
from kvarn_vllm.config import (
    INVARIANT_ENV,
    VERIFY_AS_DECODE_ENV,
    env_flag,
    parse_kv_cache_dtype,
)

__all__ = ["KvarnAttentionImpl", "staging_report"]  # noqa: F822 (built lazily)

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

_STAGING: dict[str, Any] = {
    "bytes": 0,
    "layers": 0,
    "slots": 0,
    "tokens": 0,
    "staging_tiles": 1,
    "recent_tiles": 0,
    "group_size": 0,
    "sink": False,
    "window_keys": True,
    "batch_invariant": False,
    "verify_as_decode": False,
    "cache_bytes_per_token": 0.0,
    "shared_layers": 0,
    "frame_query_bytes": 0,
    "logged": False,
}


def staging_report() -> dict[str, Any]:
    """Staging allocated in this process so far: total bytes, layers, slots, tokens/slot."""
    return {k: v for k, v in _STAGING.items() if k != "logged"}


def log_staging_once() -> None:
    """Log the staging total once per process (called by the metadata builder)."""
    if _STAGING["logged"] or not _STAGING["layers"]:
        return
    _STAGING["logged"] = True
    logger.info(
        "kvarn: staging for open tiles: %d slots (max_num_seqs, no concurrency cap) x %d "
        "tokens x %d layers = %.3f GiB, allocated at model build so vLLM's memory profiling "
        "counts it; lower --max-num-seqs to shrink it.",
        _STAGING["slots"],
        _STAGING["tokens"],
        _STAGING["layers"],
        _STAGING["bytes"] / 2**30,
    )
    per_token = _STAGING.get("cache_bytes_per_token", 0.0)
    if per_token > 0 and _STAGING["slots"]:
        # What the staging would hold as quantized cache instead (same layers, same heads).
        tokens = _STAGING["bytes"] / per_token
        logger.info(
            "kvarn: that is the memory of about %s tokens of this KV cache (%s per request "
            "slot); each slot fewer gives the cache that many.",
            f"{round(tokens):,}",
            f"{round(tokens / _STAGING['slots']):,}",
        )
    if _STAGING.get("sink"):
        logger.info(
            "kvarn: each request's first tile (the attention sink) stays exact in staging (%d "
            "of those tokens) besides its quantized record; set KVARN_VLLM_EXACT_SINK=0 to "
            "quantize it too and give that staging to the KV cache.",
            _STAGING["group_size"],
        )
    if not _STAGING.get("window_keys", True) and (
        _STAGING.get("sink") or _STAGING.get("recent_tiles", 0)
    ):
        logger.info(
            "kvarn: the exact tiles keep only their values exact; attention reads their keys "
            "from the records (half their staging); set KVARN_VLLM_WINDOW_KEYS=1 to keep their "
            "keys exact too."
        )
    if _STAGING.get("recent_tiles", 0):
        logger.info(
            "kvarn: the %d complete tile(s) (%d tokens) before the tile a step starts in stay "
            "exact in staging besides their records, and attention reads them there; set "
            "KVARN_VLLM_RECENT_TILES=0 to read them quantized and give that staging to the KV "
            "cache.",
            _STAGING["recent_tiles"],
            _STAGING["recent_tiles"] * _STAGING["group_size"],
        )
    if _STAGING.get("staging_tiles", 1) > 1:
        logger.info(
            "kvarn: speculative decoding: staging holds S=%d open tiles (%d tokens) per request "
            "and layer, so that a complete tile waits there until its tokens are accepted; "
            "draft layers run on the same kvarn format.",
            _STAGING["staging_tiles"],
            _STAGING["staging_tiles"] * _STAGING["group_size"],
        )
        if _STAGING.get("frame_query_bytes"):
            logger.info(
                "kvarn: with auto key frames the staging also keeps each open tile's "
                "last-position query (%.3f GiB of the total above), so a tile committed from "
                "accepted drafts is judged by the same query as without speculation.",
                _STAGING["frame_query_bytes"] / 2**30,
            )
        if _STAGING.get("verify_as_decode") and not _STAGING.get("batch_invariant"):
            logger.info(
                "kvarn: verify blocks run as decode rows, one per token, so that greedy outputs "
                "match a run without speculation about as often as bf16's do (n-gram, SmolLM2, "
                "H200: 94.4-96.4%% agree, bf16 93.0-96.0%%). A block of 1 + k tokens then reads its "
                "context 1 + k times: faster than the multi-query kernel where the Gluon kernel "
                "decodes (kvarn_k4v2/k4v4 at head_dim 128: 0.28-0.45x), 2.1-2.5x slower where "
                "the Triton kernel does alone. Set %s=0 for the multi-query kernel.",
                VERIFY_AS_DECODE_ENV,
            )
        elif not _STAGING.get("batch_invariant"):
            logger.info(
                "kvarn: %s=0: verify blocks run through the multi-query kernel, which rounds "
                "differently from decode: greedy outputs can differ from a run without "
                "speculation in about one token in eight (n-gram, SmolLM2, H200: 87.0-88.7%% "
                "agree, bf16 93.0-96.0%%). Unset it to run them as decode rows (94.4-96.4%%), or "
                "set %s=1 for this run and the one to compare with (99.6%%).",
                VERIFY_AS_DECODE_ENV,
                INVARIANT_ENV,
            )


def _make_impl_class() -> type:
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import AttentionImpl, AttentionType

    from kvarn_vllm import kernels

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
            unsupported = []
            if alibi_slopes is not None:
                unsupported.append("ALiBi slopes")
            if logits_soft_cap:
                unsupported.append(f"logits soft-capping ({logits_soft_cap})")
            if attn_type != AttentionType.DECODER:
                unsupported.append(f"attention type {attn_type!r}")
            if extra.get("sinks") is not None:
                unsupported.append("attention sinks")
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
            if kv_sharing_target_layer_name is not None:
                _STAGING["shared_layers"] += 1  # attends without K/V of its own
            else:
                dtype = (
                    vllm_config.model_config.dtype
                    if vllm_config.model_config
                    else (torch.get_default_dtype())
                )
                num_slots = int(vllm_config.scheduler_config.max_num_seqs)
                # Model build runs under `with torch.device(target)`: this lands on the GPU.
                # The frame queries follow the staging's layout (one entry per key tile).
                area = (self.preset, dtype, torch.get_default_device())
                ring: dict[str, Any] = dict(
                    staging_tiles=self.config.ring_tiles,
                    sink=self.config.sink,
                    key_tiles=self.config.key_tiles,
                )
                self.staging = kernels.allocate_staging(
                    num_slots, self.num_kv_heads, head_size, *area, **ring
                )
                _STAGING["bytes"] += self.staging.numel() * self.staging.element_size()
                if self.config.frame_queries:
                    self.frame_queries = kernels.allocate_frame_queries(
                        num_slots, self.num_heads, head_size, *area, **ring
                    )
                    fq_bytes = self.frame_queries.numel() * self.frame_queries.element_size()
                    _STAGING["bytes"] += fq_bytes
                    _STAGING["frame_query_bytes"] += fq_bytes
                _STAGING["layers"] += 1
                _STAGING["slots"] = num_slots
                _STAGING["tokens"] = self.config.staging_tokens
                _STAGING["staging_tiles"] = self.config.staging_tiles
                _STAGING["recent_tiles"] = self.config.recent_tiles
                _STAGING["group_size"] = self.preset.group_size
                _STAGING["sink"] = self.config.sink
                _STAGING["window_keys"] = self.config.window_keys
                _STAGING["batch_invariant"] = self.config.batch_invariant
                _STAGING["verify_as_decode"] = self.config.verify_as_decode
                layout = tile_layout(self.preset, head_size)
                _STAGING["cache_bytes_per_token"] += (
                    self.num_kv_heads * layout.tile_bytes / layout.group_size
                )
            self.workspace = None
            if dense_context_enabled():
                self.workspace = _dense_workspace(
                    self.num_kv_heads, head_size, vllm_config, torch.get_default_device()
                )

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
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError(
                    "fused output quantization is not supported by kvarn-vllm"
                )
            assert output is not None, "kvarn-vllm writes into vLLM's output buffer"
            if attn_metadata is None:
                return output.fill_(0)  # profiling run without metadata
            kv_cache = compat.cache_records(kv_cache)  # vLLM 0.29+: [B, H, 1, C] view
            md = attn_metadata
            n = md.num_actual_tokens
            staging = self._staging(layer)
            if md.plan is not None and key is not None and value is not None:
                auto = self.config.mixed_key_frames
                kernels.store_kv(
                    key[:n],
                    value[:n],
                    kv_cache,
                    staging,
                    md.plan,
                    self.preset,
                    key_frame=self.config.key_frame,
                    query=query[:n] if auto else None,
                    frame_queries=self.frame_queries,
                )
            window = self.sliding_window
            if md.decode is not None:
                g = md.decode
                # The whole batch writes its output in place; gathered rows are scattered back.
                # A per-token group (verify blocks as decode rows) has a row per query token.
                whole = g.token_index is None
                m = g.num_tokens if g.per_token else md.num_reqs
                res = kernels.decode_attention(
                    query[:m] if whole else query.index_select(0, g.token_index),
                    kv_cache,
                    staging,
                    g.block_table,
                    g.seq_lens,
                    g.quantized_lens,
                    g.staging_slots,
                    self.preset,
                    self.scale,
                    sliding_window=window,
                    out=output[:m] if whole else None,
                    sink_lens=g.sink_lens,
                    sink_slots=g.sink_slots,
                    batch_invariant=self.config.batch_invariant,
                    raw_keys=self.config.mixed_key_frames,
                    key_lens=g.key_lens,
                    key_tiles=self.config.key_tiles,
                    # The default launch sizes splits for the step, not this group's rows:
                    # a verify row run as a decode row then splits as a decode would.
                    split_batch=md.num_reqs,
                )
                if not whole:
                    output.index_copy_(0, g.token_index, res)
            if md.fresh is not None:
                self._fresh(md.fresh, query, key, value, output, n)
            runs = None if md.context is None else self._verify_runs(md.context)
            if (
                md.context is not None
                and md.causal
                and _use_dense_context(md.context, self.workspace)
            ):
                self._context_dense(md.context, query, key, value, kv_cache, staging, output, n)
            elif md.context is not None and runs is not None:
                self._context_runs(md.context, runs, query, kv_cache, staging, output, n, md.causal)
            elif md.context is not None:
                g = md.context
                q = group_rows(g, query, n)
                # A non-causal block (a drafter's) reads its own tokens from staging, where
                # the store above put them: the kernel attends each row's whole sequence.
                as_decode = self._verify_as_decode(g)
                if as_decode or not md.causal:
                    res = self._decode_rows(g, q, kv_cache, staging, output, n, md)
                    if g.token_index is not None:
                        output.index_copy_(0, g.token_index, res)
                    return output
                own = None if self.config.batch_invariant else self._own_kv(g, key, value, n)
                res = kernels.multi_query_attention(
                    q,
                    g.query_start_loc,
                    kv_cache,
                    staging,
                    g.block_table,
                    g.seq_lens,
                    g.quantized_lens,
                    g.staging_slots,
                    self.preset,
                    self.scale,
                    sliding_window=window,
                    max_query_len=g.max_query_len,
                    out=output[:n] if g.token_index is None else None,
                    sink_lens=g.sink_lens,
                    sink_slots=g.sink_slots,
                    batch_invariant=self.config.batch_invariant,
                    fresh_kv=own,
                    raw_keys=self.config.mixed_key_frames,
                    key_lens=g.key_lens,
                    key_tiles=self.config.key_tiles,
                    split_batch=md.num_reqs,
                )
                if g.token_index is not None:
                    output.index_copy_(0, g.token_index, res)
            return output

        def _decode_rows(self, g, q, kv_cache, staging, output, n, md):
            """A context group's query tokens as decode rows, one per token: verify blocks in
            the default launch (``KVARN_VLLM_VERIFY_AS_DECODE``), or a drafter's non-causal
            block, whose rows each attend the whole sequence. The same computation as
            ``multi_query_attention``'s decode-row path, with the per-row lengths and tables
            (:func:`row_expansion`) computed by the step's first layer and reused by the
            others. The whole batch's output is written in place, padding rows past the last
            query left as they were; a gathered group's result is returned."""
            whole = g.token_index is None
            e = row_expansion(g, q.shape[0], md.causal)
            # Written in place where every row is a query (outside a CUDA graph capture,
            # whose replays may bring padding rows); else masked below.
            direct = whole and n == g.num_tokens and not _capturing()
            res = kernels.decode_attention(
                q,
                kv_cache,
                staging,
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
            from kvarn_vllm.metadata import STEP

            by_layer = STEP.target_metadata
            if by_layer is None:
                raise RuntimeError(
                    f"kvarn-vllm: do_kv_cache_update on layer {layer.layer_name!r} outside a "
                    "DFlash proposal: kvarn stores K/V inside forward, and a drafter's context "
                    "with the target step's plan (kvarn_vllm.metadata.STEP.proposing)"
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
                key, value, kv_cache, self._staging(layer), md.plan, self.preset,
                key_frame="rotated",
            )  # fmt: skip

        def _staging(self, layer):
            """This layer's staging, or for a layer that shares an earlier layer's KV cache,
            that layer's."""
            if self.staging is not None:
                return self.staging
            return _shared_staging(layer.kv_sharing_target_layer_name)

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

        def _context_runs(self, g, runs, query, kv_cache, staging, output, n, causal):
            """A batch-invariant context group in ``runs`` of verify blocks and of longer
            chunks (:meth:`_verify_runs`), each through :meth:`_context_mqa`, every run
            reading its own tokens from the cache."""
            q = group_rows(g, query, n)
            res = torch.empty_like(q)
            qs = [int(x) for x in g.query_start_loc_host]
            for lo, hi in runs:
                a, b = qs[lo], qs[hi]
                self._context_mqa(g, q[a:b], kv_cache, staging, lo, hi, res[a:b], None, causal)
            write_group_rows(g, output, res, n)

        def _context_dense(self, g, query, key, value, kv_cache, staging, output, n):
            """Chunks after cached tokens through dense attention: rows are taken in runs
            whose contexts fit the workspace together; each row's context is written into it
            in the model dtype and the rotated frame: the cached tokens dequantized from their
            records (tile 0 from the sink rows where the row keeps it exact, recent and open
            tiles from staging; with values-only windows only their values, the keys of the
            tiles before ``key_lens`` from the records), the chunk's own tokens exact from
            this step's K/V (as a
            first chunk attends them, and as decoding would: a query never reads its own
            tile quantized); then FlashAttention's varlen kernel attends them with the
            rotated queries. A sliding-window layer takes only the tiles some query of the
            row can see. A row whose context alone exceeds the workspace goes through the
            multi-query kernel, which reads the chunk's own tokens exact the same way. The
            host knows every length (no speculative decoding), so the batching is a loop over
            rows on the host."""
            h = g.host
            gsize = self.preset.group_size
            q = group_rows(g, query, n)
            own = self._own_kv(g, key, value, n)  # a KV-sharing layer has none: staging
            fresh_k, fresh_v = (None, None) if own is None else own
            res = torch.empty_like(q)
            ws = self.workspace
            qs = [int(x) for x in g.query_start_loc_host]
            ring, base = self.config.ring_tokens, self.config.sink_rows
            kring = None if self.config.key_tiles is None else self.config.key_tiles * gsize

            def halves(slot: int):
                """A slot's staged keys and values, ``[rows, H, D]`` each."""
                st = staging[slot]
                return (st[0], st[1]) if kring is None else (st[:kring], st[kring:])

            window = self.sliding_window
            # Per row, the first position some query sees, rounded down to a tile: keys
            # [first, seq_len) go to the workspace (FlashAttention aligns queries to the end).
            firsts = []
            for i, seq_len in enumerate(int(x) for x in h["seq_lens"]):
                start = seq_len - (qs[i + 1] - qs[i])
                firsts.append(0 if window is None else max(0, start - window + 1) // gsize * gsize)
            lens = [int(x) - f for x, f in zip(h["seq_lens"], firsts, strict=True)]
            for lo, hi in dense_runs(lens, ws.shape[1]):
                q_lo, q_hi = qs[lo], qs[hi]
                if lens[lo] > ws.shape[1]:  # one row, too long to dequantize
                    own_rows = None
                    if own is not None and not self.config.batch_invariant:
                        own_rows = (own[0][q_lo:q_hi], own[1][q_lo:q_hi])
                    self._context_mqa(
                        g, q[q_lo:q_hi], kv_cache, staging, lo, hi, res[q_lo:q_hi], own_rows
                    )
                    continue
                off = 0
                for i in range(lo, hi):
                    seq_len, quant = int(h["seq_lens"][i]), int(h["quantized_lens"][i])
                    slot, first = int(h["staging_slots"][i]), firsts[i]
                    # This step's tokens [fresh, seq_len) come exact from the batch.
                    fresh = seq_len - (qs[i + 1] - qs[i]) if fresh_k is not None else seq_len
                    quant = min(quant, fresh)  # value records below, exact at and above
                    # Keys as the kernels read them: from records below max(quant, key_lens)
                    # (key_lens: values-only windows), from their ring above; tile 0's keys
                    # from the ring too while it is the step's own tile (key_lens < G).
                    kq = quant if kring is None else min(int(h["key_lens"][i]), fresh)
                    rec_end = max(quant, kq)
                    stage_k, stage_v = halves(slot)
                    if rec_end > first:
                        # Whole tiles (the one holding `fresh` is complete when quant > fresh
                        # would have been: it has a record); exact rows overwrite the rest.
                        end = -(-rec_end // gsize) * gsize
                        blocks = g.block_table[i, first // gsize : end // gsize].contiguous()
                        n_q = end - first
                        kernels.dequantize(
                            kv_cache,
                            blocks,
                            self.preset,
                            self.head_size,
                            dtype=q.dtype,
                            out=(ws[0, off : off + n_q], ws[1, off : off + n_q]),
                        )
                        if first == 0 and quant >= gsize and int(h["sink_lens"][i]) and base:
                            sink_k, sink_v = halves(int(h["sink_slots"][i]))
                            ws[1, off : off + gsize] = sink_v[:gsize]
                            if kring is None:
                                ws[0, off : off + gsize] = sink_k[:gsize]
                            elif kq < gsize:
                                ws[0, off : off + gsize] = stage_k[:gsize]  # p % kring = p
                    # positions from max(quant, first) (values), max(rec_end, first) (keys) on
                    for part, start, rows_of, src in (
                        (1, max(quant, first), None, stage_v),
                        (0, max(rec_end, first), kring, stage_k),
                    ):
                        pos = torch.arange(start, fresh, device=q.device)
                        rows = (
                            kernels.staging_rows(pos, ring, base)
                            if rows_of is None
                            else pos % rows_of
                        )
                        ws[part, off + start - first : off + fresh - first] = src.index_select(
                            0, rows
                        )
                    if fresh < seq_len:
                        a, b = off + fresh - first, off + seq_len - first
                        ws[0, a:b] = fresh_k[qs[i] : qs[i + 1]]
                        ws[1, a:b] = fresh_v[qs[i] : qs[i + 1]]
                    off += seq_len - first
                kv_lens = torch.as_tensor(lens[lo:hi], dtype=torch.int32)
                cu_k = torch.zeros(hi - lo + 1, dtype=torch.int32)
                torch.cumsum(kv_lens, 0, out=cu_k[1:])
                q_rot = kernels.rotate(q[q_lo:q_hi])
                o_rot = torch.empty_like(q_rot)
                flash = _flash_prefill(self.head_size)
                if flash is not None:
                    flash_fn, fa_version = flash
                    cu_q = g.query_start_loc[lo : hi + 1] - g.query_start_loc[lo]
                    flash_fn(
                        q_rot,
                        ws[0, :off],
                        ws[1, :off],
                        max_seqlen_q=max(qs[i + 1] - qs[i] for i in range(lo, hi)),
                        cu_seqlens_q=cu_q,
                        max_seqlen_k=int(kv_lens.max()),
                        cu_seqlens_k=cu_k.to(q.device),
                        softmax_scale=self.scale,
                        causal=True,
                        window_size=None if window is None else [window - 1, 0],
                        out=o_rot,
                        fa_version=fa_version,
                    )
                else:
                    exact_causal_attention(
                        q_rot,
                        ws[0, :off],
                        ws[1, :off],
                        o_rot,
                        [x - q_lo for x in qs[lo : hi + 1]],
                        self.scale,
                        window,
                        kv_start_loc=cu_k.tolist(),
                    )
                res[q_lo:q_hi] = kernels.unrotate(o_rot)
            write_group_rows(g, output, res, n)

        def _context_mqa(self, g, q, kv_cache, staging, lo, hi, out, own, causal=True):
            """Rows ``lo:hi`` of a context group through the multi-query kernel (``own``: their
            tokens' K/V from this step, rotated; ``causal=False``: each row's tokens attend its
            whole sequence)."""
            qs = g.query_start_loc_host
            max_query_len = int(max(int(qs[i + 1]) - int(qs[i]) for i in range(lo, hi)))
            kernels.multi_query_attention(
                q,
                g.query_start_loc[lo : hi + 1] - g.query_start_loc[lo],
                kv_cache,
                staging,
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
            window = self.sliding_window
            flash = _flash_prefill(self.head_size)
            done = False
            if flash is not None:
                flash_fn, fa_version = flash
                try:
                    flash_fn(
                        q,
                        k,
                        v,
                        max_seqlen_q=g.max_query_len,
                        cu_seqlens_q=g.query_start_loc,
                        max_seqlen_k=g.max_query_len,
                        cu_seqlens_k=g.query_start_loc,
                        softmax_scale=self.scale,
                        causal=True,
                        window_size=None if window is None else [window - 1, 0],
                        out=o,
                        fa_version=fa_version,
                    )
                    done = True
                except Exception as exc:  # argument/shape refusal: use Triton from now on
                    _PREFILL["flash"] = None
                    logger.warning(
                        "kvarn: FlashAttention %s refused the first-chunk prefill "
                        "(%s); using vLLM's Triton prefill kernel instead",
                        fa_version,
                        exc,
                    )
            triton_fn = None if done else compat.triton_prefill()
            if triton_fn is not None:
                lens = g.query_start_loc[1:] - g.query_start_loc[:-1]
                triton_fn(
                    q,
                    k,
                    v,
                    o,
                    g.query_start_loc[:-1],
                    lens,
                    g.max_query_len,
                    is_causal=True,
                    softmax_scale=self.scale,
                    sliding_window_q=None if window is None else window - 1,
                )
            elif not done:
                exact_causal_attention(q, k, v, o, g.query_start_loc_host, self.scale, window)
            if not whole:
                output.index_copy_(0, g.token_index, o)

    KvarnAttentionImpl.__module__ = __name__
    KvarnAttentionImpl.__qualname__ = "KvarnAttentionImpl"
    return KvarnAttentionImpl


_PREFILL: dict[str, Any] = {}

DENSE_CONTEXT_ENV = "KVARN_VLLM_DENSE_CONTEXT"
DENSE_CONTEXT_MIN_QUERY = 64


DENSE_CONTEXT_WORKSPACE_BYTES = 256 * 2**20
_WORKSPACES: dict[tuple[Any, ...], Any] = {}


def dense_context_enabled() -> bool:
    """``KVARN_VLLM_DENSE_CONTEXT`` (default ``1``; ``0`` sends every continuation chunk
    through the multi-query kernel)."""
    return env_flag(DENSE_CONTEXT_ENV, True)


def _use_dense_context(group: Any, workspace: Any) -> bool:
    """Whether a context group goes through :meth:`_context_dense`: only with a workspace
    (``KVARN_VLLM_DENSE_CONTEXT`` on), when the host knows the rows' lengths exactly (no
    speculative decoding) and some row brings at least ``DENSE_CONTEXT_MIN_QUERY`` query
    tokens (a chunked-prefill continuation, not a verify)."""
    if workspace is None:
        return False
    return group.host is not None and group.max_query_len >= DENSE_CONTEXT_MIN_QUERY


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def row_expansion(group: Any, num_rows: int, causal: bool) -> dict[str, Any]:
    """A context group's ``num_rows`` query tokens as decode rows: each token's sequence
    (``rows``), length (``row_lens``: its position + 1, or with ``causal=False`` the whole
    sequence), and its sequence's table row, read lengths, staging slot, sink and key lengths;
    ``valid`` marks the tokens before the group's last query (the rest is padding of a CUDA
    graph). Computed once per model forward and group: the first layer's call stores it on
    the group for the others (every layer of a step reads the same rows). Within a CUDA
    graph capture the ops are captured once, by the first layer, and replay before the other
    layers read their results; outside a forward (tests) nothing is kept."""
    import torch
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ctx = get_forward_context() if is_forward_context_available() else None
    key = (num_rows, causal, _capturing())
    memo = group.expansion
    if ctx is not None and memo is not None and memo[0] is ctx and memo[1] == key:
        return memo[2]
    from kvarn_vllm import kernels

    qsl = group.query_start_loc
    rows, row_lens = kernels.decode_rows(qsl, num_rows, group.seq_lens, causal)
    tables = kernels.row_tables(
        rows,
        group.block_table,
        group.quantized_lens,
        group.staging_slots,
        group.sink_lens,
        group.sink_slots,
        group.key_lens,
    )
    tokens = torch.arange(num_rows, device=qsl.device)
    valid = (tokens < qsl[qsl.shape[0] - 1]).view(-1, 1, 1)
    e = {"rows": rows, "row_lens": row_lens, "valid": valid, **tables._asdict()}
    if ctx is not None:
        group.expansion = (ctx, key, e)
    return e


def group_rows(group: Any, t: Any, n: int) -> Any:
    """The rows of ``t`` (queries, keys or values of the step's ``n`` tokens) that belong to a
    row group: all ``n`` when the group is the whole batch, else its ``token_index``."""
    return t[:n] if group.token_index is None else t.index_select(0, group.token_index)


def write_group_rows(group: Any, output: Any, res: Any, n: int) -> None:
    """Write a row group's results ``res`` back into the step's ``output`` (inverse of
    :func:`group_rows`)."""
    if group.token_index is None:
        output[:n].copy_(res)
    else:
        output.index_copy_(0, group.token_index, res)


def query_runs(query_start_loc: Any, limit: int) -> list[tuple[int, int]]:
    """Maximal runs ``[lo, hi)`` of consecutive rows whose query lengths (from the host
    ``query_start_loc``) are all at most ``limit``, or all above it."""
    starts = [int(x) for x in query_start_loc]
    lens = [b - a for a, b in itertools.pairwise(starts)]
    runs: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or (lens[i] <= limit) != (lens[lo] <= limit):
            runs.append((lo, i))
            lo = i
    return runs


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


def _dense_workspace(num_kv_heads: int, head_size: int, vllm_config: Any, device: Any) -> Any:
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


def _flash_prefill(head_size: int) -> tuple[Any, int] | None:
    """FlashAttention for exact prefill, decided once per process and logged once.

    Without it (e.g. the GPU machine without its ``fa3`` part) the first chunk goes
    through vLLM's Triton varlen kernel.
    """
    if "flash" not in _PREFILL:
        _PREFILL["flash"] = compat.flash_attn_prefill(head_size)
        found = _PREFILL["flash"]
        logger.info(
            "kvarn: exact first-chunk prefill via %s",
            f"FlashAttention {found[1]}" if found else "vLLM's Triton prefill kernel",
        )
    return _PREFILL["flash"]


def exact_causal_attention(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    query_start_loc: Any,
    scale: float,
    sliding_window: int | None = None,
    kv_start_loc: Any = None,
) -> Any:
    """Causal attention of each sequence's queries over its keys, in torch (reference path).

    Used where vLLM's Triton kernels or FlashAttention are unavailable (vLLM without a GPU
    driver), and by the tests. ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[S, Hkv, D]``,
    ``query_start_loc`` host ints ``[B+1]``; ``kv_start_loc`` host ints ``[B+1]`` (default:
    ``query_start_loc``, each sequence's queries over its own tokens); a sequence's queries
    are its last positions. Writes ``out`` ``[T, Hq, D]``.
    """
    import torch

    group = q.shape[1] // k.shape[1]
    kv_loc = query_start_loc if kv_start_loc is None else kv_start_loc
    for b in range(len(query_start_loc) - 1):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        klo, khi = int(kv_loc[b]), int(kv_loc[b + 1])
        if hi <= lo:
            continue
        qb = q[lo:hi].transpose(0, 1).float()
        kb = k[klo:khi].transpose(0, 1).float().repeat_interleave(group, 0)
        vb = v[klo:khi].transpose(0, 1).float().repeat_interleave(group, 0)
        qpos = torch.arange(hi - lo, device=q.device) + (khi - klo) - (hi - lo)
        kpos = torch.arange(khi - klo, device=q.device)
        allowed = qpos[:, None] >= kpos[None, :]
        if sliding_window is not None:
            allowed &= qpos[:, None] - kpos[None, :] < sliding_window
        scores = (qb @ kb.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ vb).transpose(0, 1).to(out.dtype)
    return out


def _shared_staging(target_layer_name: str) -> Any:
    return compat.forward_context_layer(target_layer_name).impl.staging


_IMPL: type | None = None


def __getattr__(name: str) -> Any:
    global _IMPL
    if name == "KvarnAttentionImpl":
        if _IMPL is None:
            _IMPL = _make_impl_class()
            globals()["KvarnAttentionImpl"] = _IMPL
        return _IMPL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
