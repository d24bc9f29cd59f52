"""Input checks shared by the public launchers.

Every check raises ``ValueError`` naming the argument, what was expected and what arrived.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvarn_math.layout import Preset, TileLayout, get_preset, tile_layout

from kvarn_kernels._triton import INTERPRET

__all__ = [
    "MODEL_DTYPES",
    "check_cache",
    "check_frame_queries",
    "check_preset",
    "check_same_device",
    "check_staging",
    "check_tensor",
]

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_preset(preset: str | Preset, head_dim: int) -> tuple[Preset, TileLayout]:
    """Resolve ``preset`` and its layout at ``head_dim`` (ValueError for unknown ones)."""
    p = get_preset(preset)
    return p, tile_layout(p, head_dim)


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and (
        t.dim() != len(shape)
        or any(want is not None and got != want for want, got in zip(shape, t.shape, strict=True))
    ):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want_s}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if last_dim_contiguous and t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, a CUDA one unless Triton's interpreter runs; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first}), got {dev}"
            )
    if first.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"{first_name} must be on a CUDA device (or run with TRITON_INTERPRET=1), got {first}"
        )
    return first


def check_cache(
    kv_cache: object, layout: TileLayout, num_kv_heads: int | None = None
) -> torch.Tensor:
    """``kv_cache`` uint8 ``[num_blocks, num_kv_heads, tile_bytes]`` contiguous."""
    return check_tensor(
        "kv_cache",
        kv_cache,
        dtype=torch.uint8,
        shape=(None, num_kv_heads, layout.tile_bytes),
        contiguous=True,
    )


def check_staging(
    staging: object,
    layout: TileLayout,
    num_kv_heads: int | None,
    staging_tiles: int | None = None,
    sink: bool = False,
    key_tiles: int | None = None,
) -> torch.Tensor:
    """``staging`` ``[num_slots, 2, (S + sink)*G, num_kv_heads, head_dim]`` contiguous, model
    dtype; with ``key_tiles`` (values-only windows) ``[num_slots, key_tiles*G + (S + sink)*G,
    num_kv_heads, head_dim]`` (:func:`kvarn_kernels.staging_shape`)."""
    g = layout.group_size
    if key_tiles is not None:
        t = check_tensor("staging", staging, dtype=MODEL_DTYPES, ndim=4, contiguous=True)
        rows = None
        if staging_tiles is not None:
            rows = (key_tiles + staging_tiles + int(sink)) * g
        check_tensor("staging", t, shape=(None, rows, num_kv_heads, layout.head_dim))
        if t.shape[1] % g or t.shape[1] < (2 * key_tiles + int(sink)) * g:
            raise ValueError(
                f"staging dim 1 must be a multiple of G={g} holding key_tiles={key_tiles} key "
                f"tiles and at least as many value tiles, got {t.shape[1]}"
            )
        return t
    t = check_tensor("staging", staging, dtype=MODEL_DTYPES, ndim=5, contiguous=True)
    positions = None if staging_tiles is None else (staging_tiles + int(sink)) * g
    check_tensor("staging", t, shape=(None, 2, positions, num_kv_heads, layout.head_dim))
    if t.shape[2] % g or t.shape[2] == 0:
        raise ValueError(
            f"staging dim 2 must be a positive multiple of G={g} (S*G), got {t.shape[2]}"
        )
    return t


def check_frame_queries(
    frame_queries: object, query: torch.Tensor, num_slots: int, key_rows: int, group_size: int
) -> torch.Tensor:
    """``frame_queries`` ``[num_slots, T, num_q_heads, head_dim]`` contiguous, ``query``'s dtype
    and device: the staging's slots, one entry ``T = key_rows / G`` per tile of its ``key_rows``
    key rows per slot (its view's key ring and key sink), ``query``'s heads and head_dim
    (:func:`kvarn_kernels.frame_query_shape`)."""
    t = check_tensor("frame_queries", frame_queries, dtype=(query.dtype,), ndim=4, contiguous=True)
    want = (num_slots, key_rows // group_size, query.shape[1], query.shape[2])
    if tuple(t.shape) != want:
        raise ValueError(
            f"frame_queries must be {list(want)} (staging slots, the staging's key tiles, the "
            f"query's heads and head_dim; kvarn_kernels.frame_query_shape), got {list(t.shape)}"
        )
    check_same_device(query=query, frame_queries=t)
    return t
