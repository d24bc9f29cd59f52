"""Launchers of the store: :func:`store_kv` (paged, per layer) and dense tile quantization."""

from __future__ import annotations

import math

import numpy as np
import torch
import triton  # type: ignore[import-untyped]
from kvarn_math.layout import Preset, TileLayout
from kvarn_math.ranges import OVERFLOW_MODES
from kvarn_math.tile import KEY_FRAMES
from kvarn_math.varnorm import DEFAULT_ITERATIONS

from kvarn_kernels import settings
from kvarn_kernels._format import offset_constants
from kvarn_kernels._guards import (
    MODEL_DTYPES,
    check_cache,
    check_frame_queries,
    check_preset,
    check_same_device,
    check_staging,
    check_tensor,
)
from kvarn_kernels._triton import PRECISE_MATH
from kvarn_kernels.cache import staging_view
from kvarn_kernels.plan import StorePlan
from kvarn_kernels.quantize.kernel import quantize_tiles_kernel, stage_tokens_kernel

__all__ = ["encode_tiles", "quantize_tiles", "store_kv"]

_STAGE_BLOCK_T = 16


STORE_WARPS_ENV = "KVARN_KERNELS_STORE_WARPS"
"""Environment variable: warps per program of the tile quantization (4, 8, 16 or 32) instead
of :func:`_num_warps`'s choice. For measurements (``python -m kvarn_kernels.bench
--store-sweep``); an engine leaves it unset."""


def _num_warps(layout: TileLayout) -> int:
    # The [G, D] fp32 tile lives in registers several times over during normalization. 128x128
    # tiles on an H200 (2026-12-03, 64-tile prefill chunk, 8 KV heads, key frames chosen, two
    # sweeps): 0.788 ms with 8 warps, 0.915 with 16, 1.095 with 32; so 8 up to 128x128, 16
    # past it (128x256: the largest tile, _MAX_TILE_ELEMENTS).
    warps = settings.current().store_warps
    if warps is not None:
        return warps
    elems = layout.group_size * layout.head_dim
    return 4 if elems <= 4096 else 8 if elems <= 16384 else 16


# One program holds a whole tile (keys or values) in fp32; past 32768 elements its regrouping for
# the packed store needs more shared memory than an sm_90 SM has (a 128 x 512 tile: 256 KiB).
_MAX_TILE_ELEMENTS = 32768


def _check_tile_size(layout: TileLayout) -> None:
    elems = layout.group_size * layout.head_dim
    if elems > _MAX_TILE_ELEMENTS:
        smaller = _MAX_TILE_ELEMENTS // layout.head_dim
        raise ValueError(
            f"{layout.preset.name} at head_dim {layout.head_dim} has {elems} elements per tile; "
            f"the store kernel takes at most {_MAX_TILE_ELEMENTS} (G x head_dim): use a preset "
            f"with G <= {smaller} at this head_dim"
        )


def _check_clip_ratios(clip_ratios: tuple[float, ...]) -> None:
    # kvarn-math's experimental per-row clipping search is not part of any preset; the kernels
    # implement the format's definition (plain min/max RTN) only.
    if tuple(clip_ratios) != ():
        raise ValueError(
            f"clip_ratios must be () (plain RTN) in kvarn-kernels, got {clip_ratios!r}; the "
            "clipping search exists only in kvarn_math"
        )


def _check_iterations(iterations: int) -> int:
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an int >= 0, got {iterations!r}")
    return iterations


# The kernel's KEY_FRAME: kvarn_math.tile.KEY_FRAMES, and "given" (per-tile flags, dense API).
_FRAME_MODE = {"rotated": 0, "auto": 1, "given": 2}


def _launch_quantize(
    key: torch.Tensor,
    value: torch.Tensor,
    staging: torch.Tensor,
    kv_cache: torch.Tensor,
    tiles: torch.Tensor,
    layout: TileLayout,
    iterations: int,
    fresh_rotated: bool,
    sink: bool = False,
    key_tiles: int | None = None,
    key_frame: str = "rotated",
    query: torch.Tensor | None = None,
    frames: torch.Tensor | None = None,
    frame_queries: torch.Tensor | None = None,
    overflow_count: torch.Tensor | None = None,
) -> None:
    if tiles.shape[0] == 0:
        return
    p, d = layout.preset, layout.head_dim
    sv = staging_view(staging, p.group_size, sink, key_tiles)
    cache_f16 = kv_cache.view(torch.float16)
    num_kv_heads = kv_cache.shape[1]
    group = 1
    q_arg, stride_qt, stride_qh = tiles, 0, 0  # unread unless key_frame == "auto"
    if key_frame == "auto":
        assert query is not None
        group = query.shape[1] // num_kv_heads
        q_arg, stride_qt, stride_qh = query, query.stride(0), query.stride(1)
    fq, fq_strides = _frame_query_args(q_arg, frame_queries)
    grid = (tiles.shape[0], num_kv_heads, 2)  # (tile, KV head, keys|values)
    quantize_tiles_kernel[grid](
        key,
        key.stride(0),
        key.stride(1),
        value,
        value.stride(0),
        value.stride(1),
        staging,
        sv.slot,
        sv.value_offset,
        sv.row,
        sv.head,
        kv_cache,
        cache_f16,
        kv_cache.stride(0),
        kv_cache.stride(1),
        tiles,
        q_arg,
        stride_qt,
        stride_qh,
        tiles if frames is None else frames,
        fq,
        *fq_strides,
        float(np.float32(1.0 / math.sqrt(d))),
        tiles if overflow_count is None else overflow_count,  # unread without a counter
        G=p.group_size,
        D=d,
        SG=sv.ring,
        SINK_ROWS=sv.sink,
        KSG=sv.key_ring,
        KSINK=sv.key_sink,
        GROUP=group,
        KEY_FRAME=_FRAME_MODE[key_frame],
        KEY_BITS=p.key_bits,
        VALUE_BITS=p.value_bits,
        ITERS=iterations,
        **offset_constants(layout),
        FRESH_ROTATED=fresh_rotated,
        PRECISE=PRECISE_MATH,
        STAGED_QUERIES=frame_queries is not None,
        COUNT_OVERFLOW=overflow_count is not None,
        num_warps=_num_warps(layout),
    )


def _frame_query_args(
    query: torch.Tensor, frame_queries: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The kernels' ``fq`` operand and its slot, tile and head strides (``query``, unread,
    when there are none)."""
    if frame_queries is None:
        return query, (0, 0, 0)
    st = frame_queries.stride()
    return frame_queries, (st[0], st[1], st[2])


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    staging: torch.Tensor,
    plan: StorePlan,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
    *,
    key_frame: str = "rotated",
    query: torch.Tensor | None = None,
    frame_queries: torch.Tensor | None = None,
    overflow_count: torch.Tensor | None = None,
) -> None:
    """Store one layer's fresh K/V of a step: quantize completed tiles, stage the rest.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]`` fp16/bf16/fp32, original frame
        value: ``[num_tokens, num_kv_heads, head_dim]`` fp16/bf16/fp32, original frame
            (after RoPE); last dim contiguous, other strides free.
        kv_cache: uint8 ``[num_blocks, num_kv_heads, tile_bytes]``, written in place.
        staging: ``[num_slots, 2, S*G, num_kv_heads, head_dim]`` rotated frame, written in place
            (``G + S*G`` positions when the plan keeps the sink: see :func:`plan_store`; with a
            ``window_keys=False`` plan the 4-D area of ``staging_shape(key_tiles=S - R)``).
        plan: this step's :func:`kvarn_kernels.plan_store` result, on the cache's device.
        preset: the cache preset.
        iterations: variance-normalization sweeps (kvarn-math's default).
        key_frame: ``"rotated"`` (every tile's keys Hadamard-rotated) or ``"auto"``: per tile
            and KV head, keys in the rotated frame or in their own channels, whichever loses
            less of the attention scores of the query at the tile's last position
            (kvarn_math.tile.frame_query_rows); the record's ``KEYS_UNROTATED`` flag says which
            (kvarn_math.tile.choose_key_frames).
        query: ``[num_tokens, num_q_heads, head_dim]`` the step's queries, original frame
            (after RoPE), rows as ``key``'s; needed with ``key_frame="auto"``.
        frame_queries: with ``key_frame="auto"``, the area of :func:`frame_query_shape` for
            ``staging`` (``query``'s dtype), written in place: each staged token at a tile's
            last position leaves its query there, and a tile all of whose tokens were staged
            (a speculative step committing accepted drafts) is judged by it. Without it such a
            tile is judged by its request's first query of the step, a different query than
            when the step writes the tile's last token itself; plans without speculative
            commits (``num_committed`` of every row its total) make no such tiles.
        overflow_count: optional int32 ``[1]`` on the cache's device: each tile half (keys or
            values) too large for a record (magnitudes past about 1e9) adds 1. Such tiles are
            stored saturated either way, as ``kvarn_math.encode_tiles(overflow="saturate")``
            does: a store cannot raise (``docs/reliability.md``).

    Launch order: tiles are quantized first (they may read staged tokens whose positions the
    fresh tokens of this step reuse), then the fresh tokens are written to staging.
    """
    check_tensor("key", key, dtype=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
    _, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, dtype=key.dtype, shape=tuple(key.shape), last_dim_contiguous=True)
    p, layout = check_preset(preset, head_dim)
    _check_tile_size(layout)
    if plan.group_size != p.group_size:
        raise ValueError(
            f"plan was made for G={plan.group_size}, preset {p.name} has G={p.group_size}"
        )
    check_cache(kv_cache, layout, num_kv_heads)
    check_staging(staging, layout, num_kv_heads, plan.staging_tiles, plan.sink, plan.key_tiles)
    check_tensor("plan.tiles", plan.tiles, dtype=torch.int32, shape=(None, 5), contiguous=True)
    check_tensor("plan.writes", plan.writes, dtype=torch.int32, shape=(None, 4), contiguous=True)
    check_same_device(
        kv_cache=kv_cache,
        key=key,
        value=value,
        staging=staging,
        plan_tiles=plan.tiles,
        plan_writes=plan.writes,
    )
    _check_iterations(iterations)
    if overflow_count is not None:
        check_tensor("overflow_count", overflow_count, dtype=torch.int32, shape=(1,))
        check_same_device(kv_cache=kv_cache, overflow_count=overflow_count)
    if key_frame not in KEY_FRAMES:
        raise ValueError(f"key_frame must be one of {KEY_FRAMES}, got {key_frame!r}")
    if key_frame == "auto":
        if query is None:
            raise ValueError('key_frame="auto" chooses from the queries: pass query=')
        check_tensor("query", query, dtype=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
        if (
            query.shape[0] < key.shape[0]
            or query.shape[2] != head_dim
            or query.shape[1] % num_kv_heads
        ):
            raise ValueError(
                f"query must be [>= {key.shape[0]} tokens, a multiple of {num_kv_heads} heads, "
                f"{head_dim}], got {list(query.shape)}"
            )
        check_same_device(key=key, query=query)
    sv = staging_view(staging, p.group_size, plan.sink, plan.key_tiles)
    if frame_queries is not None:
        if key_frame != "auto":
            raise ValueError(
                f'frame_queries are read only with key_frame="auto", got key_frame={key_frame!r}'
            )
        assert query is not None
        key_rows = sv.key_ring + sv.key_sink
        check_frame_queries(frame_queries, query, staging.shape[0], key_rows, p.group_size)
    _launch_quantize(
        key,
        value,
        staging,
        kv_cache,
        plan.tiles,
        layout,
        iterations,
        False,
        plan.sink,
        plan.key_tiles,
        key_frame=key_frame,
        query=query,
        frame_queries=frame_queries,
        overflow_count=overflow_count,
    )
    rows = plan.writes.shape[0]
    if rows:
        # Without frame queries the kernel reads no query: the variant launched is as before.
        q_arg = key if query is None or frame_queries is None else query
        fq, fq_strides = _frame_query_args(q_arg, frame_queries)
        staged_q = frame_queries is not None
        grid = (triton.cdiv(rows, _STAGE_BLOCK_T), num_kv_heads)
        stage_tokens_kernel[grid](
            key,
            key.stride(0),
            key.stride(1),
            value,
            value.stride(0),
            value.stride(1),
            staging,
            sv.slot,
            sv.value_offset,
            sv.row,
            sv.head,
            plan.writes,
            rows,
            q_arg,
            q_arg.stride(0),
            q_arg.stride(1),
            fq,
            *fq_strides,
            float(np.float32(1.0 / math.sqrt(head_dim))),
            D=head_dim,
            BLOCK_T=_STAGE_BLOCK_T,
            G=p.group_size if staged_q else 1,
            GROUP=q_arg.shape[1] // num_kv_heads if staged_q else 1,
            STAGED_QUERIES=staged_q,
            num_warps=4,
        )


def _dense(
    k: torch.Tensor,
    v: torch.Tensor,
    preset: str | Preset,
    iterations: int,
    rotated: bool,
    raw_keys: bool | torch.Tensor = False,
    overflow: str = "raise",
) -> torch.Tensor:
    kname, vname = ("k_rot", "v_rot") if rotated else ("k", "v")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    check_tensor(kname, k, dtype=MODEL_DTYPES)
    if k.dim() < 2:
        raise ValueError(f"{kname} must be [..., G, D], got shape {list(k.shape)}")
    check_tensor(vname, v, dtype=k.dtype, shape=tuple(k.shape))
    check_same_device(**{kname: k, vname: v})
    g, d = k.shape[-2:]
    p, layout = check_preset(preset, d)
    _check_tile_size(layout)
    if g != p.group_size:
        raise ValueError(
            f"{p.name} tiles hold {p.group_size} tokens, got {g} (shape {list(k.shape)})"
        )
    _check_iterations(iterations)
    lead = tuple(k.shape[:-2])
    n = math.prod(lead)
    records = torch.empty((n, 1, layout.tile_bytes), dtype=torch.uint8, device=k.device)
    if n:
        k_flat = k.reshape(n * g, 1, d).contiguous()
        v_flat = v.reshape(n * g, 1, d).contiguous()
        ids = torch.arange(n, dtype=torch.int32)
        tiles = torch.stack(
            [ids, torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids), ids * g], 1
        ).to(k.device)
        # The staging operand is never read (num_staged = 0); it only fixes the rounding dtype.
        staging = k_flat.view(n * g, 1, 1, 1, d)[:1].expand(1, 2, g, 1, d)
        frames = _raw_keys_tensor(raw_keys, lead, k.device)
        count = torch.zeros(1, dtype=torch.int32, device=k.device) if overflow == "raise" else None
        _launch_quantize(
            k_flat,
            v_flat,
            staging,
            records,
            tiles,
            layout,
            iterations,
            rotated,
            key_frame="rotated" if frames is None else "given",
            frames=frames,
            overflow_count=count,
        )
        if count is not None and int(count.item()):
            raise ValueError(
                f"{int(count.item())} tile halves (keys or values) are past what a KVarN record "
                "holds (magnitudes past about 1e9; kvarn_math.quantize_tiles names the tile); "
                "overflow='saturate' stores them saturated, as store_kv does"
            )
    return records.reshape(*lead, layout.tile_bytes)


def _raw_keys_tensor(
    raw_keys: bool | torch.Tensor, lead: tuple[int, ...], device: torch.device
) -> torch.Tensor | None:
    """``raw_keys`` as int8 ``[tiles, 1]`` on ``device``, or ``None`` when no tile is raw."""
    if isinstance(raw_keys, bool):
        if not raw_keys:
            return None
        return torch.ones((math.prod(lead), 1), dtype=torch.int8, device=device)
    if not isinstance(raw_keys, torch.Tensor) or raw_keys.dtype != torch.bool:
        raise ValueError(
            f"raw_keys must be a bool or a bool tensor (one per tile), got {raw_keys!r}"
        )
    try:
        expanded = raw_keys.to(device).expand(lead)
    except RuntimeError:
        raise ValueError(
            f"raw_keys must be a bool or one flag per tile {list(lead)}, "
            f"got shape {list(raw_keys.shape)}"
        ) from None
    return expanded.reshape(-1, 1).to(torch.int8).contiguous()


def quantize_tiles(
    k: torch.Tensor,
    v: torch.Tensor,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
    clip_ratios: tuple[float, ...] = (),
    raw_keys: bool | torch.Tensor = False,
    overflow: str = "raise",
) -> torch.Tensor:
    """Rotate and encode dense tiles (``kvarn_math.quantize_tiles`` on the GPU).

    Args:
        k: ``[..., G, D]`` original-frame keys (after RoPE) and values, fp16/bf16/fp32.
        v: ``[..., G, D]`` original-frame keys (after RoPE) and values, fp16/bf16/fp32.
        preset: the preset; ``G`` must be its group size.
        iterations: variance-normalization sweeps.
        clip_ratios: must be ``()`` (kvarn-math's experimental clipping is not implemented).
        raw_keys: a bool, or a bool tensor ``[...]`` (one per tile): tiles whose keys are
            stored in their own channels, flagged ``KEYS_UNROTATED``.
        overflow: ``"raise"`` (``ValueError`` after the launch, one host sync) or
            ``"saturate"`` for tiles too large for a record (kvarn_math.ranges).

    Returns:
        uint8 ``[..., tile_bytes]`` records.  The rotated tokens are rounded to ``k.dtype``
        before quantizing, exactly as :func:`store_kv` does through its staging area (raw
        keys are rotated back from there).
    """
    _check_clip_ratios(clip_ratios)
    return _dense(k, v, preset, iterations, rotated=False, raw_keys=raw_keys, overflow=overflow)


def encode_tiles(
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    preset: str | Preset,
    iterations: int = DEFAULT_ITERATIONS,
    clip_ratios: tuple[float, ...] = (),
    raw_keys: bool | torch.Tensor = False,
    overflow: str = "raise",
) -> torch.Tensor:
    """Encode dense tiles already in the rotated frame (``kvarn_math.encode_tiles``).

    Args:
        k_rot: ``[..., G, D]`` rotated keys and values.
        v_rot: ``[..., G, D]`` rotated keys and values.
        clip_ratios: must be ``()`` (kvarn-math's experimental clipping is not implemented).
        raw_keys: only ``False``: records of keys in their own channels come from
            :func:`quantize_tiles` (or the store).
        overflow: ``"raise"`` or ``"saturate"``, as :func:`quantize_tiles`.

    Returns:
        uint8 ``[..., tile_bytes]`` records.
    """
    _check_clip_ratios(clip_ratios)
    if raw_keys is not False:
        raise ValueError(
            "encode_tiles on the GPU takes rotated keys only (raw_keys=False); "
            "use quantize_tiles(..., raw_keys=...) for keys in their own channels"
        )
    return _dense(k_rot, v_rot, preset, iterations, rotated=True, overflow=overflow)
