"""Compile every kernel variant an engine launches, before it serves (:func:`warmup`).

Triton compiles a kernel the first time it sees a new combination of compile-time constants.
An engine that never warms them up compiles mid-serving: the H200 profile of 2026-11-30 found
about 11 s of a 12-prompt 16K burst spent that way (the multi-query kernel once per query
block size, the dense-context kernels, the split variants). :func:`warmup` launches each
variant once on a scratch cache of a few tiles: the store (tile quantization and staging
writes), decode, multi-query attention for every query block size (with and without the
step's own K/V), the combine kernel, dequantization and both rotations. Step-varying integers
(split counts, window, row counts) and the alignment of the per-sequence metadata are not
specialized by the kernels, so one launch covers every value.

Compiling is most of its time on a cold Triton cache (55 s of an engine start on the H200,
2026-12-03). Triton releases the GIL for its compiler passes and ``ptxas``, so with
``threads > 1`` (``KVARN_KERNELS_WARMUP_THREADS``, default 4: 21.5 s on the H200, 2026-12-04) the launches after the store run from a
thread pool and their variants compile side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch
from kvarn_math.tile import KEY_FRAMES

from kvarn_kernels import settings
from kvarn_kernels._guards import check_preset
from kvarn_kernels._triton import INTERPRET
from kvarn_kernels.attention import autotune_enabled, decode_attention, multi_query_attention
from kvarn_kernels.attention.launch import (
    VERIFY_AS_DECODE_MAX_QUERY,
    query_block_sizes,
)
from kvarn_kernels.attention.launch import batch_invariant as invariant_mode
from kvarn_kernels.cache import allocate_cache, allocate_frame_queries, allocate_staging
from kvarn_kernels.dequantize import dequantize
from kvarn_kernels.plan import plan_store
from kvarn_kernels.quantize import store_kv
from kvarn_kernels.rotation import rotate, unrotate

__all__ = ["WARMUP_THREADS_ENV", "compiled_variants", "warmup", "warmup_threads"]

WARMUP_THREADS_ENV = "KVARN_KERNELS_WARMUP_THREADS"


def warmup_threads(threads: int | None, device: torch.device) -> int:
    """The threads :func:`warmup` compiles with: ``threads``, else ``KVARN_KERNELS_WARMUP_THREADS``
    (default 4); always 1 off CUDA, under Triton's interpreter (which patches ``tl`` for the
    kernel it runs, so runs one kernel at a time) and with autotuning (its timings would
    include the other threads' launches)."""
    if threads is None:
        threads = settings.current().warmup_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"warm-up threads must be a positive integer, got {threads!r}")
    return 1 if INTERPRET or device.type != "cuda" or autotune_enabled() else threads


def warmup(
    preset: str,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    staging_tiles: int = 1,
    sink: bool = False,
    sliding_window: int | None = None,
    batch_invariant: bool | None = None,
    own_kv: Sequence[bool] = (False, True),
    key_frame: str = "rotated",
    key_tiles: int | None = None,
    frame_queries: bool = False,
    count_overflow: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """Launch every kernel variant an engine with this shape uses, on scratch tensors.

    Args:
        preset: the cache preset.
        head_dim: ``D``.
        num_q_heads: query heads of a layer (on this rank).
        num_kv_heads: KV heads of a layer (on this rank).
        dtype: the model dtype (queries, keys, values, staging).
        device: where the engine runs.
        staging_tiles: ``S``, ring tiles of the engine's staging (the open ones, 2 under
            speculative decoding, plus any recent tiles the engine keeps exact).
        sink: whether staging keeps each request's exact first tile (the engine then passes
            ``sink_lens`` to every attention call).
        sliding_window: a sliding-window layer's window (the kernels take it as a runtime
            value; passing it also warms the masked path).
        batch_invariant: the mode the engine passes to the attention kernels (``None``: the
            ``KVARN_KERNELS_BATCH_INVARIANT`` environment variable).
        own_kv: the multi-query variants the engine launches: without the step's own K/V
            (``False``) and with it (``True``, ``multi_query_attention(fresh_kv=...)``).
        key_frame: the store's ``key_frame`` (``"auto"`` also makes the attention kernels
            read each record's key frame, ``raw_keys=True``).
        key_tiles: values-only exact windows (``plan_store(window_keys=False)``): the key
            ring's tiles, the engine's open tiles ``S - R`` (staging of
            ``staging_shape(key_tiles=)``); ``None``: windows keep keys too.
        frame_queries: whether the engine passes ``store_kv(frame_queries=)`` (speculative
            decoding with ``key_frame="auto"``).
        count_overflow: whether the engine passes ``store_kv(overflow_count=)`` (kvarn-vllm
            does, per layer).
        threads: threads that launch (and so compile) the variants after the store
            (:func:`warmup_threads`).

    Returns:
        ``{"launches": n, "seconds": s, "query_block_sizes": [...], "threads": t}``.
    """
    p, _ = check_preset(preset, head_dim)
    if not own_kv or any(not isinstance(x, bool) for x in own_kv):
        raise ValueError(f"own_kv must be a non-empty sequence of bools, got {own_kv!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    device = torch.device(device)
    threads = warmup_threads(threads, device)
    start = time.perf_counter()
    g = p.group_size
    blocks = 3
    seq_len = 2 * g + 3  # two quantized tiles, three staged tokens
    cache = allocate_cache(blocks + 1, num_kv_heads, head_dim, p, device)
    staging = allocate_staging(
        2, num_kv_heads, head_dim, p, dtype, device, staging_tiles, sink, key_tiles
    )
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)

    launches = 0
    key, value = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
    table_host = np.arange(1, blocks + 1, dtype=np.int32).reshape(1, blocks)
    plan = plan_store(
        [0],
        [seq_len],
        None,
        [0],
        table_host,
        p,
        staging_tiles=staging_tiles,
        sink=sink,
        recent_tiles=0 if key_tiles is None else staging_tiles - key_tiles,
        window_keys=key_tiles is None,
    )
    if key_frame not in KEY_FRAMES:
        raise ValueError(f"key_frame must be one of {KEY_FRAMES}, got {key_frame!r}")
    auto = key_frame == "auto"
    query_all = randn(seq_len, num_q_heads, head_dim) if auto else None
    fq = None
    if frame_queries:
        fq = allocate_frame_queries(
            2, num_q_heads, head_dim, p, dtype, device, staging_tiles, sink, key_tiles
        )
    store_kv(
        key,
        value,
        cache,
        staging,
        plan.to(device),
        p,
        key_frame=key_frame,
        query=query_all,
        frame_queries=fq,
        overflow_count=torch.zeros(1, dtype=torch.int32, device=device) if count_overflow else None,
    )
    launches += 2

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    table = torch.as_tensor(table_host, device=device)
    lens, quant, slots = ints(seq_len), ints(2 * g), ints(0)
    # An engine with the sink rows passes them to every call (SINK_ROWS is a constant).
    sink_lens, sink_slots = (ints(g), ints(0)) if sink else (None, None)
    scale = head_dim**-0.5
    sizes = query_block_sizes(num_q_heads // num_kv_heads, batch_invariant)
    invariant = invariant_mode(batch_invariant)
    # Each task launches one attention variant; inputs are made here, in order (one generator).
    # One wave of tasks per window: the window is a runtime value, so the second wave launches
    # the variants the first compiled, and runs after it rather than compiling them again
    # beside it.
    waves: list[list[Callable[[], object]]] = []
    for window in [None] if sliding_window is None else [None, int(sliding_window)]:
        tasks: list[Callable[[], object]] = []
        waves.append(tasks)
        common: dict[str, Any] = dict(
            sliding_window=window,
            sink_lens=sink_lens,
            sink_slots=sink_slots,
            batch_invariant=batch_invariant,
            raw_keys=auto,
        )
        if key_tiles is not None:
            common.update(key_lens=ints(g), key_tiles=key_tiles)
        query = randn(1, num_q_heads, head_dim)
        tasks.append(
            partial(decode_attention, query, cache, staging, table, lens, quant, slots, p, scale,
                    **common)
        )  # fmt: skip
        launches += 2
        for size in sizes:
            # Batch-invariant verify blocks may run as decode rows (warmed above); longer
            # blocks take the multi-query kernel, whose variant this launch compiles.
            n = max(size, VERIFY_AS_DECODE_MAX_QUERY + 1) if invariant else size
            q = randn(n, num_q_heads, head_dim)
            for own in own_kv:
                fresh = (
                    (randn(n, num_kv_heads, head_dim), randn(n, num_kv_heads, head_dim))
                    if own
                    else None
                )
                tasks.append(
                    partial(
                        multi_query_attention,
                        q, ints(0, n), cache, staging, table, lens, quant, slots, p, scale,
                        max_query_len=n, fresh_kv=fresh, **common,
                    )
                )  # fmt: skip
                launches += 2
    rows = table[0, :2].contiguous()
    waves[0].append(lambda: unrotate(rotate(dequantize(cache, rows, p, head_dim, dtype=dtype)[0])))
    launches += 3
    for wave in waves:
        _run(wave, device, threads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "launches": launches,
        "seconds": time.perf_counter() - start,
        "query_block_sizes": sizes,
        "threads": threads,
    }


def _run(tasks: list[Callable[[], object]], device: torch.device, threads: int) -> None:
    """Run ``tasks`` in order, or from ``threads`` threads (an error in one is raised here)."""
    if threads <= 1:
        for task in tasks:
            task()
        return
    index: int | None = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # The store's writes first: the tasks read its tiles, from the threads' default stream.
        torch.cuda.synchronize(index)
        # Triton keeps compiled variants per device in a defaultdict: create each kernel's
        # entry here, so that two threads never both create it and one lose the other's work.
        for kernel in _kernels():
            _ = kernel.device_caches[index]

    def in_thread(task: Callable[[], object]) -> None:
        if index is not None:
            torch.cuda.set_device(index)  # the current device is per thread
        task()

    with ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as pool:
        for future in [pool.submit(in_thread, task) for task in tasks]:
            future.result()


def _kernels() -> list[Any]:
    """Every Triton kernel an engine launches while serving."""
    from kvarn_kernels.attention.fast import fast_decode_partial_kernel
    from kvarn_kernels.attention.kernel import attention_combine_kernel, attention_partial_kernel
    from kvarn_kernels.attention.prep import prepare_queries_kernel
    from kvarn_kernels.attention.tiles import tiles_decode_partial_kernel
    from kvarn_kernels.dequantize.kernel import dequantize_kernel
    from kvarn_kernels.quantize.kernel import quantize_tiles_kernel, stage_tokens_kernel
    from kvarn_kernels.rotation.kernel import rotate_rows_kernel

    return [
        attention_partial_kernel,
        attention_combine_kernel,
        quantize_tiles_kernel,
        stage_tokens_kernel,
        dequantize_kernel,
        rotate_rows_kernel,
        prepare_queries_kernel,  # the fast decode path: its query rows, then the Gluon kernel
        fast_decode_partial_kernel,
        tiles_decode_partial_kernel,  # the records where the Gluon kernel does not apply
    ]


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each kernel holds (all devices), ``{}`` under Triton's
    interpreter. An engine that compiles mid-serving shows it here: take it before and after."""
    counts = {}
    for kernel in _kernels():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return {}
        counts[kernel.__name__] = sum(len(entry[0]) for entry in caches.values())
    return counts
