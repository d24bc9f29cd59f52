"""Launchers of attention over the quantized paged cache."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.layout import Preset, TileLayout

from kvarn_kernels import settings
from kvarn_kernels._format import offset_constants
from kvarn_kernels._guards import (
    MODEL_DTYPES,
    check_cache,
    check_preset,
    check_same_device,
    check_staging,
    check_tensor,
)
from kvarn_kernels._triton import INTERPRET
from kvarn_kernels.attention.kernel import (
    attention_combine_kernel,
    attention_partial_kernel,
    attention_partial_kernel_autotuned,
    default_launch,
)
from kvarn_kernels.attention.prep import prepare_queries
from kvarn_kernels.cache import staging_view

__all__ = [
    "choose_num_splits",
    "decode_attention",
    "decode_rows",
    "fast_decode_applies",
    "fast_decode_supported",
    "multi_query_attention",
    "query_block_sizes",
    "set_tiles_decode",
    "split_sizing",
    "tiles_decode_applies",
]

_LOG2E = 1.4426950408889634
_MAX_GROUP = 16
_ATTENTION_HEAD_DIMS = (64, 128, 256)
_MAX_SPLITS = 64
# Batch-invariant splits hold at least this many positions: a split's fixed cost (query
# rotation, partial write, combine) is then small against its walk. H200, Llama-3.1-8B
# shape, against the default launch (2026-11-30, docs/kernels.md): 4-tile splits cost 27% at
# batch 64 x 16K, 1024 positions 12%, 2048 positions 5% (and 4-5% at batch 256).
_MIN_SPLIT_TOKENS = 2048
# Batch-invariant multi-query calls of at most this many query tokens per sequence (verify
# blocks of speculative decoding) run where the Gluon decode kernel applies as decode rows,
# one per token, so that a verify row and a decode row share their bits.
VERIFY_AS_DECODE_MAX_QUERY = 16


def autotune_enabled() -> bool:
    """``KVARN_KERNELS_AUTOTUNE=1``: tune the attention kernel on its first call per shape.

    Off by default: tuning benchmarks several configs on the device, which must not happen
    inside a CUDA graph capture; an engine that enables it must warm every shape up first.
    """
    return settings.current().autotune


def batch_invariant(override: bool | None = None) -> bool:
    """Batch-invariant mode: each query row's output independent of the batch.

    ``override`` (the kernels' ``batch_invariant`` argument) decides when given; else
    ``KVARN_KERNELS_BATCH_INVARIANT=1`` turns it on.

    Split-K boundaries then sit at fixed positions (``split_plan``) instead of following the
    batch size, and multi-query attention runs each query row with decode's launch (steps,
    warps, a 16-row block): a token gets the same bits whether it is decoded alone, in any
    batch, under CUDA graph padding or as a speculative verify row. The price: more splits
    (partial results) at large batch, fewer programs for a short context at small batch.
    """
    if override is not None:
        return bool(override)
    return settings.current().batch_invariant


def split_plan(max_steps: int, sub: int, group_size: int) -> tuple[int, int]:
    """``(split_steps, num_splits)`` of the batch-invariant mode: splits of whole tiles, at
    least ``_MIN_SPLIT_TOKENS`` positions each (doubled until at most ``_MAX_SPLITS`` cover
    ``max_steps``), at positions that depend on nothing but the table's width."""
    if max_steps < 1 or sub < 1 or group_size % sub:
        raise ValueError(
            f"split_plan needs max_steps >= 1 and sub dividing G, got {max_steps}, {sub}, "
            f"{group_size}"
        )
    steps = max(1, _MIN_SPLIT_TOKENS // group_size) * (group_size // sub)
    while -(-max_steps // steps) > _MAX_SPLITS:
        steps *= 2
    return steps, -(-max_steps // steps)


def launch_override() -> dict[str, int]:
    """``KVARN_KERNELS_ATTN_LAUNCH="SUB=128,num_warps=4"``: fixed launch parameters
    for the untuned kernel (for measurements; an engine leaves it unset)."""
    return settings.current().launch_override


def untuned_launch(
    decode: bool, head_dim: int, group_size: int, bits: tuple[int, int] | None = None
) -> dict[str, int]:
    """Launch parameters of the untuned kernel: :func:`default_launch` (``bits``: the
    preset's key and value bits) with any ``KVARN_KERNELS_ATTN_LAUNCH`` override."""
    return {**default_launch(decode, head_dim, group_size, bits), **launch_override()}


def launch_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_chunks: int,
    head_dim: int,
    group_size: int,
    device: torch.device,
    invariant: bool,
) -> tuple[int, int]:
    """``(split_steps, num_splits)`` the launcher picks when not given ``num_splits``: in
    batch-invariant mode :func:`split_plan` over the table with decode's step size, else
    :func:`choose_num_splits` (``split_steps`` 0: the kernel divides the sequence)."""
    if invariant:
        sub = untuned_launch(True, head_dim, group_size)["SUB"]
        return split_plan(max_chunks * group_size // sub, sub, group_size)
    return 0, choose_num_splits(num_seqs, num_kv_heads, max_chunks, device, group_size)


def fast_decode_enabled() -> bool:
    """``KVARN_KERNELS_FAST_DECODE=0`` turns the Gluon decode kernel off (default on)."""
    return settings.current().fast_decode


def fast_prefetch() -> int:
    """``KVARN_KERNELS_FAST_PREFETCH=N`` (0-4): the Gluon decode kernel prefetches into L2 the
    record ``N`` tiles ahead of the one it reads (default 1; 0: no prefetch). It changes no
    output bit."""
    return settings.current().fast_prefetch


def fast_decode_applies(
    query: torch.Tensor,
    layout: TileLayout,
    num_kv_heads: int,
    sliding_window: int | None,
) -> bool:
    """Whether :func:`decode_attention` attends the quantized tiles with the Gluon kernel of
    :mod:`kvarn_kernels.attention.fast`: ``kvarn_k4v2_g128`` and ``kvarn_k4v4_g128`` at head_dim
    128, GQA groups up to 8, fp16/bf16 queries on a GPU with ``mma.sync`` (compute capability 8.0 or newer), no
    sliding window, not autotuned, not in Triton's interpreter, and not turned off
    (:func:`fast_decode_enabled`). Batch-invariant mode is served too: the kernel's splits
    then sit at fixed positions (:func:`fast_split_plan`)."""
    return (
        fast_decode_enabled()
        and not INTERPRET
        and fast_decode_supported(layout, query.shape[1], num_kv_heads, query.dtype, sliding_window)
        and not autotune_enabled()
        and query.device.type == "cuda"
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )


def fast_decode_supported(
    layout: TileLayout,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    sliding_window: int | None,
) -> bool:
    """The shapes the fast decode kernel serves: ``kvarn_k4v2_g128`` and ``kvarn_k4v4_g128``
    at head_dim 128, up to 8 query heads per KV head, fp16/bf16 queries, no sliding window."""
    p = layout.preset
    return (
        (p.key_bits, p.group_size, layout.head_dim) == (4, 128, 128)
        and p.value_bits in (2, 4)
        and num_q_heads // num_kv_heads <= 8
        and dtype in (torch.float16, torch.bfloat16)
        and sliding_window is None
    )


_TILES_DECODE: bool | None = None


def tiles_decode_enabled() -> bool:
    """Whether :func:`decode_attention` attends the quantized tiles with the Triton tiles kernel
    (:mod:`kvarn_kernels.attention.tiles`) where the Gluon kernel does not apply: what
    :func:`set_tiles_decode` last set in this process, else ``KVARN_KERNELS_TILES_DECODE``
    (default off: an illegal memory access at head_dim 256 on an H100, 2026-12-06, not yet
    explained; ``docs/settings.md``)."""
    if _TILES_DECODE is None:
        return settings.current().tiles_decode
    return _TILES_DECODE


def set_tiles_decode(on: bool | None) -> None:
    """Turn the tiles kernel of :func:`tiles_decode_applies` on or off for this process
    (``None``: back to ``KVARN_KERNELS_TILES_DECODE``)."""
    global _TILES_DECODE
    _TILES_DECODE = None if on is None else bool(on)


def tiles_decode_applies(query: torch.Tensor, layout: TileLayout, num_kv_heads: int) -> bool:
    """Whether :func:`decode_attention` attends the quantized tiles with
    :func:`kvarn_kernels.attention.tiles.tiles_decode_partial_kernel` (where
    :func:`fast_decode_applies` does not): fp16/bf16 queries, values of 1, 2, 4 or 8 bits, any
    key width, up to 16 query heads per KV head, sliding windows included, not autotuned
    (autotuning tunes the single-kernel path), in Triton's interpreter too."""
    from kvarn_kernels.attention.tiles import TILES_N

    return (
        tiles_decode_enabled()
        and query.dtype in (torch.float16, torch.bfloat16)
        and layout.preset.value_bits in (1, 2, 4, 8)
        and query.shape[1] // num_kv_heads <= TILES_N
        and not autotune_enabled()
    )


def fast_decode_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_tiles: int,
    device: torch.device,
    staged_splits: int = 1,
    per_sm: int = 4,
    min_tiles: int = 1,
) -> int:
    """Splits of the fast decode kernel (Gluon or tiles): about ``per_sm`` programs per SM, at
    least ``min_tiles`` tiles per split (as far as the table's ``max_tiles`` go), at most the
    combine's maximum less the Triton kernel's ``staged_splits`` (:func:`staged_splits`). On a
    CPU device (Triton's interpreter) one split, as :func:`choose_num_splits` gives there, so a
    row's bits do not depend on the batch."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, (per_sm * sms) // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_tiles // max(1, min_tiles), _MAX_SPLITS - staged_splits))


def invariant_split_tiles() -> int:
    """``KVARN_KERNELS_INVARIANT_SPLIT_TILES=N``: tiles per split of the Gluon decode kernel in
    batch-invariant mode (a power of two, 1-256; default 8, 1024 positions at ``G = 128``).
    Longer splits mean fewer partials at large batch and fewer programs at small batch; the
    bits then differ from those of another ``N``, so every engine that must agree uses one
    value."""
    return settings.current().invariant_split_tiles


def fast_split_plan(table_width: int, staged_splits: int) -> tuple[int, int]:
    """``(split_tiles, num_splits)`` of the fast decode kernel in batch-invariant mode: splits
    of :func:`invariant_split_tiles` tiles from tile 0 (doubled until the table's
    ``table_width`` tiles fit beside the ``staged_splits`` of the Triton kernel in the
    combine's maximum); they depend on nothing but the table's width."""
    if table_width < 1 or not 1 <= staged_splits < _MAX_SPLITS:
        raise ValueError(
            f"fast_split_plan needs table_width >= 1 and 1 <= staged_splits < {_MAX_SPLITS}, "
            f"got {table_width}, {staged_splits}"
        )
    tiles = invariant_split_tiles()
    while -(-table_width // tiles) > _MAX_SPLITS - staged_splits:
        tiles *= 2
    return tiles, -(-table_width // tiles)


def fast_path_splits(
    staging: torch.Tensor,
    group_size: int,
    sink: bool,
    key_tiles: int | None,
    num_seqs: int,
    num_kv_heads: int,
    table_width: int,
    device: torch.device,
    invariant: bool,
    fast: bool = True,
    tiles_shape: tuple[int, int] | None = None,
) -> tuple[int, int, int]:
    """``(staged, fast_splits, split_tiles)`` of the fast decode path: the Triton kernel's
    staged splits (:func:`staged_splits`; batch-invariant, one per staged tile whatever the
    batch), and for the Gluon kernel (``fast``) its split count and, batch-invariant, the
    tiles per split (:func:`fast_split_plan`; else 0: :func:`fast_decode_splits` divides each
    sequence). ``fast=False`` (the staged pass alone) never asks the GPU for its SMs beyond
    :func:`staged_splits`. ``tiles_shape``: ``(head_dim, key_bits)`` when the Triton tiles
    kernel reads the records; its programs per SM and tiles per split follow
    :func:`kvarn_kernels.attention.tiles.tiles_splitting` (``None``: the Gluon kernel's 4
    programs per SM)."""
    programs = 0 if invariant else num_seqs * num_kv_heads
    staged = staged_splits(staging, group_size, sink, key_tiles, programs, device)
    if not fast:
        return staged, 0, 0
    if invariant:
        split_tiles, splits = fast_split_plan(table_width, staged)
        return staged, splits, split_tiles
    per_sm, min_tiles = 4, 1
    if tiles_shape is not None:
        from kvarn_kernels.attention.tiles import tiles_splitting

        per_sm, min_tiles = tiles_splitting(*tiles_shape)
    splits = fast_decode_splits(
        num_seqs, num_kv_heads, table_width, device, staged, per_sm, min_tiles
    )
    return staged, splits, 0


STAGED_SPLITS_ENV = "KVARN_KERNELS_STAGED_SPLITS"
"""Environment variable: a cap on :func:`staged_splits` (an integer >= 1; ``1`` walks the staged
tiles one after the other in one split). For measurements; an engine leaves it unset."""


def staged_splits(
    staging: torch.Tensor,
    group_size: int,
    sink: bool,
    key_tiles: int | None,
    programs: int = 0,
    device: torch.device | None = None,
) -> int:
    """Splits of the Triton kernel beside the fast decode kernel (which attends the quantized
    tiles): one per tile of rows it reads from staging (the sink tile and the ring), so that
    the exact windows' tiles are walked side by side instead of one after the other; one split
    when ``programs`` (sequences x KV heads) alone fill two per SM of the GPU ``device``; at
    most :data:`STAGED_SPLITS_ENV` when set.

    (H200, 2026-12-02, values-only windows: at batch 64 x 4K, 512 programs, one split took the
    call from 192.0 to 187.8 us, at 256 x 4K from 717.3 to 697.9 us; at batch 16, a split per
    tile from 93.3 to 81.9 us.)

    Raises:
        ValueError: :data:`STAGED_SPLITS_ENV` is set to anything but an integer >= 1.
    """
    sv = staging_view(staging, group_size, sink, key_tiles)
    splits = max(1, (sv.ring + sv.sink) // group_size)
    if device is not None and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if programs >= 2 * sms:
            splits = 1
    cap = settings.current().staged_splits
    return splits if cap is None else min(splits, cap)


def verify_as_decode(
    query: torch.Tensor,
    layout: TileLayout,
    num_kv_heads: int,
    sliding_window: int | None,
    max_query_len: int,
) -> bool:
    """Whether a batch-invariant :func:`multi_query_attention` call (without ``fresh_kv``, and
    without its ``verify_as_decode`` argument, which decides alone) runs as decode rows, one
    per query token (:func:`decode_rows`): blocks of at most
    :data:`VERIFY_AS_DECODE_MAX_QUERY` tokens (verify blocks of speculative decoding), where the
    Gluon decode kernel applies (:func:`fast_decode_applies`). Elsewhere, in batch-invariant
    mode, the multi-query kernel runs each row with decode's launch, which gives a decode row's
    bits already; a decode row per token reads the context once per token instead of once per
    block of 16 rows."""
    return max_query_len <= VERIFY_AS_DECODE_MAX_QUERY and (
        fast_decode_applies(query, layout, num_kv_heads, sliding_window)
        or tiles_decode_applies(query, layout, num_kv_heads)
    )


def decode_rows(
    query_start_loc: torch.Tensor, num_tokens: int, seq_lens: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, row_lens)`` of multi-query attention taken as decode rows, on the device and
    without a sync: query token ``i`` belongs to sequence ``rows[i]`` (int64) and is its
    position ``row_lens[i] - 1`` (int32), so a decode row of length ``row_lens[i]`` attends
    what the query does (causally). ``causal=False``: every row of a sequence attends the whole
    sequence (``row_lens`` its length). Padding tokens past ``query_start_loc[-1]`` get the
    last sequence's last position."""
    num_seqs = query_start_loc.shape[0] - 1
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=torch.int32)
    rows = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=num_seqs - 1)
    lens = seq_lens.index_select(0, rows)
    if not causal:
        return rows, lens.to(torch.int32)
    after = (query_start_loc[1:].index_select(0, rows) - 1 - tokens).clamp_(min=0)
    return rows, (lens - after).to(torch.int32)


class RowTables(NamedTuple):
    """Decode rows' per-sequence tables (:func:`row_tables`), named as
    :func:`decode_attention`'s arguments (``_asdict()`` passes them on)."""

    block_table: torch.Tensor
    quantized_lens: torch.Tensor
    staging_slots: torch.Tensor
    sink_lens: torch.Tensor | None
    sink_slots: torch.Tensor | None
    key_lens: torch.Tensor | None


def row_tables(
    rows: torch.Tensor,
    block_table: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    sink_lens: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    key_lens: torch.Tensor | None = None,
) -> RowTables:
    """The per-sequence tables of decode rows ``rows`` (each row's sequence, as
    :func:`decode_rows` gives them): each row's table row, read lengths, staging slot, sink and
    key lengths (``None`` stays ``None``)."""

    def per_row(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, rows)

    return RowTables(
        block_table.index_select(0, rows),
        quantized_lens.index_select(0, rows),
        staging_slots.index_select(0, rows),
        per_row(sink_lens),
        per_row(sink_slots),
        per_row(key_lens),
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_sizing(num_rows: int, split_batch: int | None) -> int:
    """The sequence count the default launch sizes its splits for: ``split_batch`` rounded up
    to a power of two when given (the calls of one engine step, whatever rows each gets, then
    split alike, and the layout changes only where the step's request count crosses a power of
    two), else the call's own ``num_rows``.

    Raises:
        ValueError: ``split_batch`` is not ``None`` or an int >= 1.
    """
    if split_batch is None:
        return num_rows
    if isinstance(split_batch, bool) or not isinstance(split_batch, int) or split_batch < 1:
        raise ValueError(f"split_batch must be None or an int >= 1, got {split_batch!r}")
    return _next_pow2(split_batch)


def _query_block(max_query_len: int, group: int, invariant: bool) -> int:
    """Query tokens per program of the multi-query kernel (a compile-time constant)."""
    block_h = _next_pow2(group)
    if invariant:
        return max(1, 16 // block_h)  # 16 rows, as a decode block
    return max(1, min(_next_pow2(max_query_len), 64 // block_h))


def query_block_sizes(group: int, invariant: bool | None = None) -> list[int]:
    """Every query block size the multi-query kernel compiles for ``group`` query heads per KV
    head (one kernel variant each): what :func:`kvarn_kernels.warmup` must launch."""
    on = batch_invariant(invariant)
    sizes = {_query_block(1 << i, group, on) for i in range(8)}
    return sorted(sizes)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_chunks: int,
    device: torch.device,
    group_size: int = 128,
) -> int:
    """Split-K factor: about 4 programs per SM, each with at least 256 tokens to walk.

    Args:
        num_seqs: the batch (programs = seqs x KV heads x splits).
        num_kv_heads: the batch (programs = seqs x KV heads x splits).
        max_chunks: tiles a sequence can span (block-table width + staged tiles).
        device: the GPU (CPU: 1).
        group_size: ``G``.
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-4 * sms // programs)
    most = max(1, max_chunks * group_size // 256)
    return int(max(1, min(want, most, _MAX_SPLITS)))


def _check_common(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    preset: str | Preset,
    num_seqs: int,
    sink_lens: torch.Tensor | None,
    sink_slots: torch.Tensor | None = None,
    key_lens: torch.Tensor | None = None,
    key_tiles: int | None = None,
) -> tuple[TileLayout, int]:
    check_tensor("query", query, dtype=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
    _, num_q_heads, head_dim = query.shape
    if head_dim not in _ATTENTION_HEAD_DIMS:
        raise ValueError(
            f"head_dim must be one of {_ATTENTION_HEAD_DIMS} for attention, got {head_dim}"
        )
    p, layout = check_preset(preset, head_dim)
    check_cache(kv_cache, layout)
    num_kv_heads = kv_cache.shape[1]
    if (key_lens is None) != (key_tiles is None):
        raise ValueError(
            "key_lens and key_tiles go together (values-only exact windows): got "
            f"key_lens={'None' if key_lens is None else 'a tensor'}, key_tiles={key_tiles!r}"
        )
    check_staging(staging, layout, num_kv_heads, sink=sink_lens is not None, key_tiles=key_tiles)
    if key_lens is not None:
        check_tensor("key_lens", key_lens, dtype=torch.int32, shape=(num_seqs,), contiguous=True)
        check_same_device(query=query, key_lens=key_lens)
    if staging.dtype != query.dtype:
        raise ValueError(f"staging dtype must equal query dtype {query.dtype}, got {staging.dtype}")
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= _MAX_GROUP:
        raise ValueError(
            f"query heads must be 1..{_MAX_GROUP} times the {num_kv_heads} KV heads, "
            f"got {num_q_heads}"
        )
    if p.key_bits not in (1, 2, 4, 8) and p.group_size < 128:
        raise ValueError(f"{p.key_bits}-bit keys need G=128 in attention, got {p.name}")
    if p.value_bits not in (1, 2, 4, 8) and head_dim < 128:
        raise ValueError(f"{p.value_bits}-bit values need head_dim >= 128, got {head_dim}")
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    if block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table must have >= {num_seqs} rows, got {list(block_table.shape)}")
    for name, t in (
        ("seq_lens", seq_lens),
        ("quantized_lens", quantized_lens),
        ("staging_slots", staging_slots),
    ):
        check_tensor(name, t, dtype=torch.int32, shape=(num_seqs,), contiguous=True)
    check_same_device(
        query=query,
        kv_cache=kv_cache,
        staging=staging,
        block_table=block_table,
        seq_lens=seq_lens,
        quantized_lens=quantized_lens,
        staging_slots=staging_slots,
    )
    if sink_lens is not None:
        check_tensor("sink_lens", sink_lens, dtype=torch.int32, shape=(num_seqs,), contiguous=True)
        check_same_device(query=query, sink_lens=sink_lens)
        if staging_view(staging, layout.group_size, True, key_tiles).ring < layout.group_size:
            raise ValueError(
                f"with sink_lens, staging must hold the G={layout.group_size} sink rows plus "
                f"S*G ring rows, got shape {list(staging.shape)}"
            )
    if sink_slots is not None:
        if sink_lens is None:
            raise ValueError("sink_slots needs sink_lens (which sequences read a sink)")
        check_tensor(
            "sink_slots", sink_slots, dtype=torch.int32, shape=(num_seqs,), contiguous=True
        )
        check_same_device(query=query, sink_slots=sink_slots)
    return layout, num_kv_heads


def _run(
    query: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    max_query_len: int,
    kv_cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    layout: TileLayout,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    num_splits: int | None,
    sink_lens: torch.Tensor | None,
    sink_slots: torch.Tensor | None = None,
    invariant: bool | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    raw_keys: bool = True,
    key_lens: torch.Tensor | None = None,
    key_tiles: int | None = None,
    staged_only: bool = False,
    causal: bool = True,
    as_decode: bool | None = None,
    split_batch: int | None = None,
) -> torch.Tensor:
    """Launch the attention kernels (the checks are the callers'). ``staged_only``: for tests,
    only the Triton kernel's part of the fast decode path, its staged splits over the sink
    rows and staging (``QUANT=False``), the quantized tiles left out; decode only.
    ``causal=False`` (multi-query only): every query attends its whole sequence.
    ``as_decode`` (multi-query only): blocks of at most :data:`VERIFY_AS_DECODE_MAX_QUERY`
    tokens as decode rows, whatever kernel decodes; ``None``: in batch-invariant mode where
    :func:`verify_as_decode` says so. ``split_batch``: :func:`split_sizing` (default launch)."""
    num_tokens, num_q_heads, d = query.shape
    num_seqs = seq_lens.shape[0]
    sizing = split_sizing(num_seqs, split_batch)
    p = layout.preset
    g = p.group_size
    if out is None:
        out = torch.empty_like(query)
    else:
        check_tensor(
            "out", out, dtype=query.dtype, shape=tuple(query.shape), last_dim_contiguous=True
        )
        check_same_device(query=query, out=out)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    sv = staging_view(staging, g, sink_lens is not None, key_tiles)
    max_chunks = block_table.shape[1] + (sv.ring + sv.sink) // g
    group = num_q_heads // num_kv_heads
    block_h = _next_pow2(group)
    decode = query_start_loc is None
    invariant = batch_invariant(invariant)
    if as_decode is None:  # batch-invariant: where decode rows give other bits (Gluon)
        as_rows = invariant and verify_as_decode(
            query, layout, num_kv_heads, sliding_window, max_query_len
        )
    else:
        as_rows = bool(as_decode) and max_query_len <= VERIFY_AS_DECODE_MAX_QUERY
    if not decode and (
        not causal or (as_rows and fresh_kv is None and not staged_only and num_splits is None)
    ):
        # One decode row per query token: a verify row then gets a decode row's bits (in
        # the default launch, those of a decode batch of these rows), which the multi-query
        # kernel cannot give where the Gluon kernel decodes; a non-causal block's rows each
        # attend the whole sequence.
        assert query_start_loc is not None
        rows, row_lens = decode_rows(query_start_loc, num_tokens, seq_lens, causal)
        t = row_tables(
            rows, block_table, quantized_lens, staging_slots, sink_lens, sink_slots, key_lens
        )
        res = _run(
            query,
            None,
            1,
            kv_cache,
            staging,
            t.block_table,
            row_lens,
            t.quantized_lens,
            t.staging_slots,
            layout,
            num_kv_heads,
            scale,
            sliding_window,
            None,
            num_splits,
            t.sink_lens,
            t.sink_slots,
            invariant,
            None,
            raw_keys,
            t.key_lens,
            key_tiles,
            split_batch=split_batch,
        )
        # Rows past query_start_loc[-1] (padding) are left untouched.
        tokens = torch.arange(num_tokens, device=query.device)
        valid = (tokens < query_start_loc[num_seqs]).view(-1, 1, 1)
        out.copy_(torch.where(valid, res, out))
        return out
    if autotune_enabled() and not invariant:
        kernel, launch = attention_partial_kernel_autotuned, {}
    else:
        # Batch-invariant: every row with decode's launch, whatever the query count.
        kernel = attention_partial_kernel
        launch = untuned_launch(decode or invariant, d, g, (p.key_bits, p.value_bits))
    if invariant and num_splits is not None:
        raise ValueError(
            "num_splits must be None in batch-invariant mode (the splits sit at fixed positions)"
        )
    split_steps = 0
    # The fast path: the Gluon kernel attends the quantized tiles in `fast_splits` splits,
    # this kernel the rest (sink rows, staging) in one split per staged tile before them; the
    # combine merges. `staged_only` (tests) launches this kernel's part alone.
    if staged_only and (not decode or invariant):
        raise ValueError("staged_only is the fast decode path's: decode, not batch-invariant")
    fast = not staged_only and (
        decode
        and num_splits is None
        and fast_decode_applies(query, layout, num_kv_heads, sliding_window)
    )
    # Elsewhere the Triton tiles kernel takes the Gluon kernel's place, with the same splits.
    # A given num_splits is the tiles kernel's split count (the staged pass keeps its own).
    # Multi-query blocks too, outside batch-invariant mode (which runs every row with decode's
    # launch, or as decode rows).
    tiles = (
        not staged_only
        and not fast
        and (decode or not invariant)
        and tiles_decode_applies(query, layout, num_kv_heads)
    )
    fast_splits = split_tiles = 0
    if num_splits is not None and (
        not isinstance(num_splits, int) or not 1 <= num_splits <= _MAX_SPLITS
    ):
        raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
    given = num_splits
    if fast or tiles or staged_only:
        num_splits, fast_splits, split_tiles = fast_path_splits(
            staging, g, sink_lens is not None, key_tiles, sizing, num_kv_heads,
            block_table.shape[1], query.device, invariant, fast or tiles,
            (d, p.key_bits) if tiles else None,
        )  # fmt: skip
        if tiles and given is not None:
            fast_splits = min(given, _MAX_SPLITS - num_splits)
        if kernel is attention_partial_kernel:
            # Each staged split walks one tile: software pipelining has nothing to overlap and
            # only costs shared memory (H200, 2026-12-02: the pass took 81 us at batch 64 x 4K
            # with values-only windows at num_stages=2, 56 us at 1).
            launch = {**launch, "num_stages": 1, **launch_override()}
    if num_splits is None:
        split_steps, num_splits = launch_splits(
            sizing, num_kv_heads, max_chunks, d, g, query.device, invariant
        )
    if not isinstance(num_splits, int) or not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
    part_splits = num_splits + fast_splits
    block_q = 1 if decode else _query_block(max_query_len, group, invariant)
    block_m = max(16, block_q * block_h)
    num_qblocks = 1 if decode else triton.cdiv(max(max_query_len, 1), block_q)
    fp32 = query.dtype == torch.float32

    acc = torch.empty(
        (num_tokens, num_q_heads, part_splits, d), dtype=torch.float32, device=query.device
    )
    ml = torch.empty(
        (num_tokens, num_q_heads, part_splits, 2), dtype=torch.float32, device=query.device
    )
    qstart = seq_lens if query_start_loc is None else query_start_loc  # unread when decoding
    fk, fv = (query, query) if fresh_kv is None else fresh_kv  # unread without FRESH
    # The fast path's query rows, prepared once for both of its kernels (one launch).
    prepared = (
        prepare_queries(query, scale, bool(raw_keys)) if fast or tiles or staged_only else None
    )
    # The staged pass takes the prepared rows when decoding (multi-query blocks rotate their own).
    staged_prepared = prepared is not None and decode
    pq, pa = (query, query) if prepared is None else prepared  # unread without PREPARED
    rsqrt_d = float(np.float32(1.0 / math.sqrt(d)))
    grid = (num_seqs, num_kv_heads, num_qblocks * num_splits)
    kernel[grid](
        query,
        query.stride(0),
        query.stride(1),
        qstart,
        kv_cache,
        kv_cache.view(torch.float16),
        kv_cache.stride(0),
        kv_cache.stride(1),
        staging,
        sv.slot,
        sv.value_offset,
        sv.row,
        sv.head,
        block_table,
        block_table.stride(0),
        seq_lens,
        quantized_lens,
        staging_slots,
        seq_lens if sink_lens is None else sink_lens,  # unread without a sink
        staging_slots if sink_slots is None else sink_slots,  # unread without a sink
        seq_lens if key_lens is None else key_lens,  # unread without values-only windows
        fk,
        fv,
        pq,
        pa,
        fk.stride(0),
        fk.stride(1),
        fv.stride(0),
        fv.stride(1),
        acc,
        ml,
        num_q_heads,
        num_splits,
        split_steps,
        part_splits,
        0,
        float(scale) * _LOG2E,
        0 if sliding_window is None else sliding_window,
        rsqrt_d,
        G=g,
        D=d,
        SG=sv.ring,
        SINK_ROWS=sv.sink,
        KSG=sv.key_ring,
        KSINK=sv.key_sink,
        VWIN=key_tiles is not None,
        KEY_BITS=p.key_bits,
        VALUE_BITS=p.value_bits,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        DECODE=decode,
        FP32=fp32,
        PHASED=p.key_bits == 4 and p.value_bits in (2, 4),
        FRESH=fresh_kv is not None,
        **offset_constants(layout),
        RAW_KEYS=bool(raw_keys),
        QUANT=not (fast or tiles or staged_only),
        PREPARED=staged_prepared,
        **launch,
    )
    if fast:
        from kvarn_kernels.attention.fast import launch_fast_decode

        assert prepared is not None
        launch_fast_decode(
            prepared,
            kv_cache,
            block_table,
            quantized_lens,
            sink_lens,
            acc,
            ml,
            num_splits,
            fast_splits,
            split_tiles,
            fast_prefetch(),
            p.value_bits,
        )
    if tiles:
        from kvarn_kernels.attention.tiles import launch_tiles_decode

        assert prepared is not None
        launch_tiles_decode(
            prepared, kv_cache, layout, block_table, seq_lens, quantized_lens, sink_lens,
            sliding_window, acc, ml, num_splits, fast_splits, split_tiles,
            query_start_loc, max_query_len, fresh_kv is not None,
        )  # fmt: skip
    qend = qstart if decode else qstart[num_seqs:]
    attention_combine_kernel[(num_tokens, num_kv_heads)](
        acc,
        ml,
        num_q_heads,
        part_splits,
        out,
        out.stride(0),
        out.stride(1),
        qend,
        rsqrt_d,
        D=d,
        GROUP=group,
        BLOCK_H=block_h,
        # One compiled combine kernel whatever the split count (a varying batch changes it).
        BLOCK_S=_next_pow2(_MAX_SPLITS),
        DECODE=decode,
        num_warps=4,
    )
    return out


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    preset: str | Preset,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sink_lens: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    raw_keys: bool = True,
    key_lens: torch.Tensor | None = None,
    key_tiles: int | None = None,
    split_batch: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its quantized tiles and staging.

    Args:
        query: ``[B, Hq, D]`` fp16/bf16/fp32, original frame (rotated inside the kernel).
        kv_cache: uint8 ``[num_blocks, Hkv, tile_bytes]``.
        staging: ``[num_slots, 2, S*G, Hkv, D]`` in query's dtype.
        block_table: int32 ``[B, max_blocks]``: tile ``t`` of sequence ``b`` is block ``[b, t]``.
        seq_lens: int32 ``[B]`` tokens of each sequence (the query is the last one).
        quantized_lens: int32 ``[B]`` tokens read from quantized tiles (multiple of G); the
            rest ``[quantized_len, seq_len)`` is read from ``staging[slot, :, p % (S*G)]``.
            With a plan that keeps recent tiles exact, pass its ``attention_lens``: those
            tiles have records too, but are read from staging.
        staging_slots: int32 ``[B]``.
        preset: the cache preset.
        scale: softmax scale (usually ``1 / sqrt(D)``).
        sliding_window: keys ``(seq_len - 1 - W, seq_len - 1]`` only.
        out: optional ``[B, Hq, D]`` output (query's dtype).
        num_splits: split-K factor; ``None`` picks one from the batch and the table width.
        sink_lens: optional int32 ``[B]``, each ``0`` or ``G``: with it, staging is
            ``[num_slots, 2, G + S*G, Hkv, D]``, rows ``[0, G)`` hold each slot's exact first
            tile (the attention sink) and rows ``G + (p - G) % (S*G)`` the positions
            ``p >= G``; a sequence with ``sink_lens[b] == G`` attends its first tile from the
            sink rows instead of its quantized record.
        sink_slots: optional int32 ``[B]`` (needs ``sink_lens``): the slot whose sink rows
            sequence ``b`` reads (default: its own ``staging_slots[b]``). A sequence that
            shares its first tile with another through the prefix cache can read the exact
            copy the other one wrote.
        batch_invariant: split-K at fixed positions, so a token's output bits do not depend
            on the batch (see :func:`batch_invariant`); ``None``: the
            ``KVARN_KERNELS_BATCH_INVARIANT`` environment variable decides.
        raw_keys: records may hold keys in their own channels (``store_kv``'s
            ``key_frame="auto"``): each tile's flag is read and such tiles are scored with the
            un-rotated query. ``False`` skips the flag, for a cache whose store only rotates.
        key_lens: int32 ``[B]``, with ``key_tiles``: values-only exact windows (a
            ``plan_store(window_keys=False)`` cache, whose staging is the 4-D area of
            ``staging_shape(key_tiles=)``): keys before ``key_lens`` (the plan's
            ``key_read_lens``) are read from their records, values only before
            ``quantized_lens`` (the sink tile's values from its sink rows).
        key_tiles: the key ring's tiles ``S_k`` (the plan's ``key_tiles``).
        split_batch: in the default launch (``num_splits`` and ``batch_invariant`` unset),
            the number of sequences to size the split-K layout for instead of ``B``, rounded up
            to a power of two (:func:`split_sizing`). An engine passes its step's request
            count to every call of the step, so that a token decoded here and the same token
            verified as a decode row in a speculative step (``multi_query_attention(...,
            verify_as_decode=True, split_batch=...)``) get the same splits, hence the same
            bits, while the step's request count stays in one power-of-two bucket. Ignored in
            batch-invariant mode, whose splits sit at fixed positions.

    Returns:
        ``[B, Hq, D]`` in the original frame, query's dtype.
    """
    check_tensor("query", query, dtype=MODEL_DTYPES, ndim=3)
    layout, num_kv_heads = _check_common(
        query,
        kv_cache,
        staging,
        block_table,
        seq_lens,
        quantized_lens,
        staging_slots,
        preset,
        query.shape[0],
        sink_lens,
        sink_slots,
        key_lens,
        key_tiles,
    )
    return _run(
        query,
        None,
        1,
        kv_cache,
        staging,
        block_table,
        seq_lens,
        quantized_lens,
        staging_slots,
        layout,
        num_kv_heads,
        scale,
        sliding_window,
        out,
        num_splits,
        sink_lens,
        sink_slots,
        batch_invariant,
        raw_keys=raw_keys,
        key_lens=key_lens,
        key_tiles=key_tiles,
        split_batch=split_batch,
    )


def multi_query_attention(
    query: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    preset: str | Preset,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    sink_lens: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    raw_keys: bool = True,
    key_lens: torch.Tensor | None = None,
    key_tiles: int | None = None,
    causal: bool = True,
    verify_as_decode: bool | None = None,
    split_batch: int | None = None,
) -> torch.Tensor:
    """Causal attention of several query tokens per sequence over the cache.

    Sequence ``b``'s queries are rows ``[query_start_loc[b], query_start_loc[b+1])`` of
    ``query`` ``[num_q_tokens, Hq, D]`` and are its last ``n_b`` positions; their own K/V must
    already be stored.  Other arguments as :func:`decode_attention`; ``max_query_len`` (host
    int, >= every ``n_b``) avoids a device sync.  Rows past ``query_start_loc[-1]`` (padding)
    are left untouched.  ``sink_lens``, ``sink_slots``, ``batch_invariant``, ``raw_keys``,
    ``key_lens``, ``key_tiles``, ``split_batch``: as :func:`decode_attention` (batch-invariant
    mode runs every query row with decode's launch).

    ``fresh_kv``: optional ``(k, v)``, each ``[num_q_tokens, Hkv, D]`` in query's dtype and the
    rotated frame (:func:`kvarn_kernels.rotate`), row ``i`` the K/V of query row ``i``'s own
    token. The queries' own positions are then attended exactly from them, even where the
    step's store completed their tiles (a long chunk would otherwise read its own earlier
    tokens from their fresh records); the positions before them are read as stored. This is
    what :func:`kvarn_math.reference_attention` computes with ``exact_kv``.

    ``causal=False``: every query of sequence ``b`` attends all of its ``seq_len`` positions,
    its block included (a non-causal draft block, as DFlash drafts; the block's K/V must be
    stored, e.g. in staging, and ``fresh_kv`` is not taken). The rows then run as decode rows of
    the whole sequence, one per query token (:func:`decode_rows`).

    ``verify_as_decode=True``: blocks of at most :data:`VERIFY_AS_DECODE_MAX_QUERY` tokens
    (verify blocks) without ``fresh_kv`` run as decode rows, one per token, so that a verify
    token is computed by the kernel and launch that decode it without speculation (the split
    layout follows ``split_batch``, or without it the number of rows); ``None``: in
    batch-invariant mode where the Gluon kernel decodes (:func:`verify_as_decode`), which then
    gives a decode row's bits exactly; ``False``: never.

    Returns:
        ``[num_q_tokens, Hq, D]`` in the original frame, query's dtype.

    Raises:
        ValueError: bad shapes or arguments, or ``causal=False`` with ``fresh_kv``.
    """
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, contiguous=True)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must have B+1 >= 1 entries, got 0")
    layout, num_kv_heads = _check_common(
        query,
        kv_cache,
        staging,
        block_table,
        seq_lens,
        quantized_lens,
        staging_slots,
        preset,
        num_seqs,
        sink_lens,
        sink_slots,
        key_lens,
        key_tiles,
    )
    check_same_device(query=query, query_start_loc=query_start_loc)
    if max_query_len is None:
        max_query_len = (
            int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if num_seqs else 0
        )
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be an int >= 0, got {max_query_len!r}")
    if fresh_kv is not None:
        if not isinstance(fresh_kv, (tuple, list)) or len(fresh_kv) != 2:
            raise ValueError("fresh_kv must be a (k, v) pair of tensors")
        want = (query.shape[0], num_kv_heads, query.shape[2])
        for name, t in zip(("fresh_kv[0]", "fresh_kv[1]"), fresh_kv, strict=True):
            check_tensor(name, t, dtype=(query.dtype,), shape=want, last_dim_contiguous=True)
            check_same_device(**{"query": query, name: t})
        fresh_kv = (fresh_kv[0], fresh_kv[1])
    if not causal and fresh_kv is not None:
        raise ValueError(
            "causal=False reads the block's own K/V as stored (decode rows of the whole "
            "sequence); fresh_kv is not taken with it"
        )
    return _run(
        query,
        query_start_loc,
        max_query_len,
        kv_cache,
        staging,
        block_table,
        seq_lens,
        quantized_lens,
        staging_slots,
        layout,
        num_kv_heads,
        scale,
        sliding_window,
        out,
        num_splits,
        sink_lens,
        sink_slots,
        batch_invariant,
        fresh_kv,
        raw_keys,
        key_lens,
        key_tiles,
        causal=bool(causal),
        as_decode=verify_as_decode,
        split_batch=split_batch,
    )
