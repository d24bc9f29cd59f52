"""Compile the kernels before vLLM serves (once per process and shape; GPU only).

vLLM's own warm-up runs 2-token prompts and decodes, so the multi-query kernel, the
dense-context path, the tile store and the speculative planners would otherwise compile
inside the first long requests. ``KVARN_VLLM_WARMUP=0`` skips it.
"""

from __future__ import annotations

import logging
from typing import Any

from kvarn_vllm import kernels
from kvarn_vllm.config import KvarnConfig, env_flag
from kvarn_vllm.staging import staging_report

__all__ = ["WARMUP_ENV", "launch_planners", "warm_kernels", "warm_planners"]

logger = logging.getLogger("vllm.kvarn")  # inherits vLLM's handler and level

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
            count_overflow=True,  # every layer counts its saturated tiles (kvarn_vllm.overflow)
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
    from kvarn_vllm.plugin import kernel_cache_dir

    with kernels.compile_cache(kernel_cache_dir()):
        launch_planners(config, device)
    return True


def launch_planners(config: KvarnConfig, device: Any) -> None:
    """Both device planners once, on one scratch row (what :func:`warm_planners` compiles)."""
    import torch

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
