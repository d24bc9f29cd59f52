"""Staging for the open tiles: allocated per layer at model build, reported once.

Staging (``[num_slots, 2, S*G, num_kv_heads, head_dim]``, model dtype) holds every request's
open tiles (and the recent ones, and the exact first tile) in the rotated frame. It is
allocated in the attention layer's ``__init__``: vLLM builds the model before it profiles
memory, so the staging is counted as model memory and the KV cache is sized from what is
left. ``num_slots`` is ``max_num_seqs``: every running request owns a slot and concurrency is
never capped below what the user asked for. This module keeps the process's total and logs
what it costs once.
"""

from __future__ import annotations

import logging
from typing import Any

from kvarn_math.layout import tile_layout

from kvarn_vllm import kernels
from kvarn_vllm.config import INVARIANT_ENV, VERIFY_AS_DECODE_ENV, KvarnConfig

__all__ = [
    "allocate_layer_staging",
    "count_shared_layer",
    "log_staging_once",
    "staging_budget_warning",
    "staging_report",
]

BUDGET_WARN_SHARE = 0.2
"""Warn once when staging passes this share of the memory vLLM may use
(``gpu_memory_utilization x total``): the KV cache gets what is left after the weights and
staging, so at 24 GiB the Llama-3.1-8B shape's 8 GiB at 256 slots leaves none
(docs/capacity.md)."""

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
    "budget_warned": False,
}


def staging_report() -> dict[str, Any]:
    """Staging allocated in this process so far: total bytes, layers, slots, tokens/slot."""
    return {k: v for k, v in _STAGING.items() if k not in ("logged", "budget_warned")}


def staging_budget_warning(
    staging_bytes: int, layers: int, slots: int, budget_bytes: float
) -> str | None:
    """The warning to log when ``staging_bytes`` (allocated so far over ``layers`` layers at
    ``slots`` request slots) passes :data:`BUDGET_WARN_SHARE` of ``budget_bytes`` (what vLLM
    may use), else None."""
    if budget_bytes <= 0 or staging_bytes <= BUDGET_WARN_SHARE * budget_bytes:
        return None
    per_slot_layer = staging_bytes / max(layers * slots, 1)
    return (
        f"kvarn: staging has reached {staging_bytes / 2**30:.2f} GiB after {layers} layer(s) at "
        f"{slots} request slots (max_num_seqs), {staging_bytes / budget_bytes:.0%} of the "
        f"{budget_bytes / 2**30:.1f} GiB vLLM may use (gpu_memory_utilization x total); the KV "
        "cache gets only what the weights and staging leave, and none left stops vLLM with 'No "
        "available memory for the cache blocks'. Each slot costs "
        f"{per_slot_layer / 2**20:.2f} MiB per layer: lower --max-num-seqs (docs/capacity.md)."
    )


def _warn_if_over_budget(device: Any) -> None:
    """:func:`staging_budget_warning` once per process, on a CUDA device inside vLLM."""
    if _STAGING["budget_warned"] or getattr(device, "type", None) != "cuda":
        return
    try:
        import torch
        from vllm.config import get_current_vllm_config

        utilization = float(get_current_vllm_config().cache_config.gpu_memory_utilization)
        total = torch.cuda.mem_get_info(device)[1]
    except Exception:  # outside an engine (tests, tools): nothing to compare with
        return
    text = staging_budget_warning(
        _STAGING["bytes"], _STAGING["layers"], _STAGING["slots"], utilization * total
    )
    if text is not None:
        _STAGING["budget_warned"] = True
        logger.warning(text)


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


def count_shared_layer() -> None:
    """A layer that shares an earlier layer's KV cache (attends without K/V of its own)."""
    _STAGING["shared_layers"] += 1


def allocate_layer_staging(
    config: KvarnConfig,
    num_slots: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: Any,
    device: Any,
) -> tuple[Any, Any]:
    """One layer's ``(staging, frame_queries)`` on ``device`` (``frame_queries`` None unless
    the settings keep each open tile's last query: auto key frames under speculative
    decoding), added to the process's report."""
    preset = config.preset
    # The frame queries follow the staging's layout (one entry per key tile).
    area = (preset, dtype, device)
    ring: dict[str, Any] = dict(
        staging_tiles=config.ring_tiles, sink=config.sink, key_tiles=config.key_tiles
    )
    staging = kernels.allocate_staging(num_slots, num_kv_heads, head_size, *area, **ring)
    _STAGING["bytes"] += staging.numel() * staging.element_size()
    frame_queries = None
    if config.frame_queries:
        frame_queries = kernels.allocate_frame_queries(
            num_slots, num_heads, head_size, *area, **ring
        )
        fq_bytes = frame_queries.numel() * frame_queries.element_size()
        _STAGING["bytes"] += fq_bytes
        _STAGING["frame_query_bytes"] += fq_bytes
    _STAGING["layers"] += 1
    _STAGING["slots"] = num_slots
    _STAGING["tokens"] = config.staging_tokens
    _STAGING["staging_tiles"] = config.staging_tiles
    _STAGING["recent_tiles"] = config.recent_tiles
    _STAGING["group_size"] = preset.group_size
    _STAGING["sink"] = config.sink
    _STAGING["window_keys"] = config.window_keys
    _STAGING["batch_invariant"] = config.batch_invariant
    _STAGING["verify_as_decode"] = config.verify_as_decode
    layout = tile_layout(preset, head_size)
    _STAGING["cache_bytes_per_token"] += num_kv_heads * layout.tile_bytes / layout.group_size
    _warn_if_over_budget(device)
    return staging, frame_queries
