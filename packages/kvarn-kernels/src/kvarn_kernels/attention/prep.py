"""The query rows the fast decode kernel reads, prepared in one launch (plain Triton).

:mod:`kvarn_kernels.attention.fast` takes each query row scaled by ``scale * log2(e)``, in the
Hadamard-rotated frame (and, where tiles may store keys in their own channels, also as it comes),
divided by its largest entry and rounded to fp16, plus that largest entry. One program handles
``BLOCK_R`` rows: it loads them once, rotates them with the butterflies of
:func:`kvarn_kernels._triton.fwht_rows` in fp32 and writes both frames, instead of the eight or so
torch launches the same arithmetic takes (which cost more than the attention itself at small
batch, inside a CUDA graph too).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import fwht_rows, unit_rows

__all__ = ["prepare_queries", "prepare_queries_kernel"]

_LOG2E = 1.4426950408889634
_BLOCK_R = 16


@triton.jit
def _write_frame(x, qs_ptr, qa_ptr, row_base, rows_ok, d, D: tl.constexpr):
    """Rows ``x`` ``[R, D]`` (fp32) -> fp16 ``x / max|x|`` at ``qs[row_base]``, ``max|x|`` (1 for
    an all-zero row) at ``qa[row_base]``."""
    y, amax = unit_rows(x)
    y = y.to(tl.float16)
    tl.store(qs_ptr + row_base[:, None] * D + d[None, :], y, mask=rows_ok[:, None])
    tl.store(qa_ptr + row_base, amax, mask=rows_ok)


@triton.jit(do_not_specialize=("num_rows",))  # the batch's rows: one variant for every batch
def prepare_queries_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    qs_ptr,
    qa_ptr,
    num_rows,
    num_q_heads,
    qk_scale,
    rsqrt_d,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FRAMES: tl.constexpr,
):
    """Rows ``r = t * Hq + h`` of ``q`` ``[T, Hq, D]`` -> ``qs`` fp16 ``[T, FRAMES, Hq, D]`` and
    ``qa`` fp32 ``[T, FRAMES, Hq]``: frame 0 rotated, frame 1 (``FRAMES = 2``) as it comes."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < num_rows
    t = (r // num_q_heads).to(tl.int64)
    h = r % num_q_heads
    d = tl.arange(0, D)
    src = q_ptr + t[:, None] * stride_qt + h[:, None].to(tl.int64) * stride_qh + d[None, :]
    x = tl.load(src, mask=ok[:, None], other=0.0).to(tl.float32) * qk_scale
    base = t * (FRAMES * num_q_heads) + h
    _write_frame(fwht_rows(x, BLOCK_R, D) * rsqrt_d, qs_ptr, qa_ptr, base, ok, d, D)
    if FRAMES == 2:
        _write_frame(x, qs_ptr, qa_ptr, base + num_q_heads, ok, d, D)


def prepare_queries(
    query: torch.Tensor, scale: float, raw_keys: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qs, qa)``: fp16 ``[B, F, Hq, D]`` rows ``q * scale * log2(e) / max|q|`` and fp32
    ``[B, F, Hq]`` ``max|q|``; frame 0 Hadamard-rotated (in fp32, as :func:`kvarn_math.rotate`),
    frame 1 (``F = 2`` with ``raw_keys``) the query as it comes. ``query`` ``[B, Hq, D]``, any
    float dtype, last dim contiguous."""
    b, hq, d = query.shape
    frames = 2 if raw_keys else 1
    qs = torch.empty((b, frames, hq, d), dtype=torch.float16, device=query.device)
    qa = torch.empty((b, frames, hq), dtype=torch.float32, device=query.device)
    rows = b * hq
    if rows:
        prepare_queries_kernel[(triton.cdiv(rows, _BLOCK_R),)](
            query,
            query.stride(0),
            query.stride(1),
            qs,
            qa,
            rows,
            hq,
            float(scale) * _LOG2E,
            float(np.float32(1.0 / math.sqrt(d))),
            D=d,
            BLOCK_R=_BLOCK_R,
            FRAMES=frames,
            num_warps=4,
        )
    return qs, qa
