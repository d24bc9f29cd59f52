"""Launchers of dequantization: paged (:func:`dequantize`) and dense records."""

from __future__ import annotations

import math

import numpy as np
import torch
from kvarn_math.layout import Preset, TileLayout

from kvarn_kernels._format import offset_constants
from kvarn_kernels._guards import (
    MODEL_DTYPES,
    check_cache,
    check_preset,
    check_same_device,
    check_tensor,
)
from kvarn_kernels.dequantize.kernel import dequantize_kernel

__all__ = ["decode_tiles", "dequantize", "dequantize_tiles"]


def _num_warps(layout: TileLayout) -> int:
    """Warps per program (one tile of one KV head): 4 up to 8192 elements per tile, else 8."""
    return 4 if layout.group_size * layout.head_dim <= 8192 else 8


def _launch(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    layout: TileLayout,
    dtype: torch.dtype,
    rotated: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = block_ids.shape[0], kv_cache.shape[1]
    p, d = layout.preset, layout.head_dim
    g = p.group_size
    if out is None:
        k = torch.empty((n * g, h, d), dtype=dtype, device=kv_cache.device)
        v = torch.empty_like(k)
    else:
        k, v = out
    if n == 0:
        return k, v
    dequantize_kernel[(n, h)](
        kv_cache,
        kv_cache.view(torch.float16),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_ids,
        k,
        v,
        k.stride(0),
        k.stride(1),
        float(np.float32(1.0 / math.sqrt(d))),
        G=g,
        D=d,
        KEY_BITS=p.key_bits,
        VALUE_BITS=p.value_bits,
        **offset_constants(layout),
        UNROTATE=not rotated,
        num_warps=_num_warps(layout),
    )
    return k, v


def dequantize(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    preset: str | Preset,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    rotated: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V of the tiles ``block_ids`` of a paged cache.

    Args:
        kv_cache: uint8 ``[num_blocks, num_kv_heads, tile_bytes]``.
        block_ids: int32 ``[n]`` blocks to read, in output order (e.g. a block-table row).
        preset: the cache preset.
        head_dim: ``D``.
        dtype: output dtype (fp16, bf16 or fp32).
        rotated: ``True`` returns the rotated frame attention reads in (tiles whose keys are
            stored in their own channels are rotated); ``False`` the original frame.
        out: ``(k, v)`` to write into instead of new tensors (e.g. slices of a preallocated
            workspace): each ``[n * G, num_kv_heads, head_dim]`` of ``dtype`` on the cache's
            device, last dimension contiguous, both with the same strides.

    Returns:
        ``(k, v)``, each ``[n * G, num_kv_heads, head_dim]``: token ``j`` of tile ``i`` is row
        ``i * G + j``.
    """
    _, layout = check_preset(preset, head_dim)
    check_cache(kv_cache, layout)
    check_tensor("block_ids", block_ids, dtype=torch.int32, ndim=1, contiguous=True)
    check_same_device(kv_cache=kv_cache, block_ids=block_ids)
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    if out is not None:
        _check_out(
            out,
            (block_ids.shape[0] * layout.preset.group_size, kv_cache.shape[1], head_dim),
            dtype,
            kv_cache.device,
        )
    return _launch(kv_cache, block_ids, layout, dtype, rotated, out)


def _check_out(
    out: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError("out must be a (k, v) tuple of tensors")
    for name, t in zip(("out[0] (k)", "out[1] (v)"), out, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"{name} must be {dtype} {list(shape)} on {device}, got {t.dtype} "
                f"{list(t.shape)} on {t.device}"
            )
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if out[0].stride() != out[1].stride():
        raise ValueError(
            f"out tensors must share strides, got {out[0].stride()} and {out[1].stride()}"
        )


def _dense(
    records: torch.Tensor, preset: str | Preset, head_dim: int, rotated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    p, layout = check_preset(preset, head_dim)
    check_tensor("records", records, dtype=torch.uint8)
    if records.dim() < 1 or records.shape[-1] != layout.tile_bytes:
        raise ValueError(
            f"records must be uint8 [..., {layout.tile_bytes}] for {p.name} at head_dim "
            f"{head_dim}, got {records.dtype} {list(records.shape)}"
        )
    lead = tuple(records.shape[:-1])
    n = math.prod(lead)
    cache = records.reshape(n, 1, layout.tile_bytes).contiguous()
    ids = torch.arange(n, dtype=torch.int32, device=records.device)
    k, v = _launch(cache, ids, layout, torch.float32, rotated)
    g = p.group_size
    return k.reshape(*lead, g, head_dim), v.reshape(*lead, g, head_dim)


def decode_tiles(
    records: torch.Tensor, preset: str | Preset, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvarn_math.decode_tiles``: records ``[..., tile_bytes]`` -> fp32 rotated ``(k, v)``.

    Returns:
        ``(k_rot, v_rot)``, each ``[..., G, D]``.
    """
    return _dense(records, preset, head_dim, rotated=True)


def dequantize_tiles(
    records: torch.Tensor, preset: str | Preset, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvarn_math.dequantize_tiles``: records -> fp32 ``(k, v)`` ``[..., G, D]``."""
    return _dense(records, preset, head_dim, rotated=False)
