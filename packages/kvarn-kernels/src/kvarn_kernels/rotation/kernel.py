"""Triton kernel of the Hadamard rotation of rows."""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import fwht_rows, round_to

__all__ = ["rotate_rows_kernel"]


@triton.jit(do_not_specialize=("num_rows",))
def rotate_rows_kernel(
    x_ptr,
    out_ptr,
    signs_ptr,
    num_rows,
    rsqrt_d,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SIGNS_FIRST: tl.constexpr,
    SIGNS_LAST: tl.constexpr,
):
    """``out = (x * signs?) @ H / sqrt(D) (* signs?)`` for ``BLOCK_R`` contiguous rows."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, D)
    mask = (r < num_rows)[:, None]
    offs = r[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SIGNS_FIRST:
        x = x * tl.load(signs_ptr + d)[None, :]
    x = fwht_rows(x, BLOCK_R, D) * rsqrt_d
    if SIGNS_LAST:
        x = x * tl.load(signs_ptr + d)[None, :]
    tl.store(out_ptr + offs, round_to(x, out_ptr.dtype.element_ty), mask=mask)
