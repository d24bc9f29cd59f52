"""Triton device code for the MLA latent cache (format: :mod:`kvarn_math.mla`): quantize-on-write,
the staging copy and dequantize/gather. The decode kernels are in :mod:`kvarn_kernels.mla.decode`.

A latent row of ``L`` channels at ``BITS`` bits is stored packed ``PER = 8 / BITS`` codes a byte:
channel ``PER * k + p`` is bit field ``p`` of byte ``k``. Readers load each byte once and take its
fields apart with shifts and masks (:func:`~kvarn_kernels.mla.decode.latent_group`).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import rint_f32
from kvarn_kernels.mla.decode import latent_group

__all__ = [
    "mla_stage_kernel",
    "mla_store_kernel",
    "mla_dequantize_kernel",
]


@triton.jit
def _fp16_round(x):
    """float32 -> float16 (saturating at +-65504) -> float32, as the record stores it."""
    return tl.clamp(x, -65504.0, 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def mla_store_kernel(
    lat_ptr,
    lat_stride,
    pe_ptr,
    pe_stride,
    slot_ptr,
    cache_u8,
    cache_f16,
    cache_i8,
    cache_stride,
    L: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    OFF_CODES: tl.constexpr,
    OFF_SCALE: tl.constexpr,
    OFF_ZERO: tl.constexpr,
    OFF_ROPE: tl.constexpr,
    OFF_ROPE_SCALE: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One program per token: quantize its latent row and RoPE key into record row ``slot % G``
    of block ``slot // G`` (``slot < 0``: padding, nothing written)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // G
        row = slot % G
        base = block * cache_stride
        PER: tl.constexpr = 8 // BITS
        NG: tl.constexpr = L // W
        LEVELS: tl.constexpr = (1 << BITS) - 1
        g_idx = tl.arange(0, NG)
        w_idx = tl.arange(0, W)
        x = tl.load(lat_ptr + t * lat_stride + g_idx[:, None] * W + w_idx[None, :]).to(tl.float32)
        lo = tl.min(x, axis=1)
        step = _fp16_round(tl.div_rn(tl.max(x, axis=1) - lo, LEVELS * 1.0))
        lo = _fp16_round(lo)
        safe = tl.where(step > 0, step, 1.0)
        q = rint_f32(tl.div_rn(x - lo[:, None], safe[:, None]), PRECISE)
        q = tl.clamp(q, 0.0, LEVELS * 1.0)
        q = tl.where(step[:, None] > 0, q, 0.0).to(tl.int32)  # [NG, W]
        # pack PER consecutive channels into a byte: field p of byte k = channel PER * k + p
        q = tl.reshape(q, (L // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(q << shifts[None, :], axis=1).to(tl.uint8)
        k_idx = tl.arange(0, L // PER)
        tl.store(cache_u8 + base + OFF_CODES + row * (L // PER) + k_idx, packed)
        tl.store(cache_f16 + (base + OFF_SCALE) // 2 + row * NG + g_idx, step.to(tl.float16))
        tl.store(cache_f16 + (base + OFF_ZERO) // 2 + row * NG + g_idx, lo.to(tl.float16))
        r_idx = tl.arange(0, R)
        pe = tl.load(pe_ptr + t * pe_stride + r_idx).to(tl.float32)
        pstep = _fp16_round(tl.div_rn(tl.max(tl.abs(pe), axis=0), 127.0))
        psafe = tl.where(pstep > 0, pstep, 1.0)
        pq = tl.clamp(rint_f32(tl.div_rn(pe, psafe), PRECISE), -127.0, 127.0).to(tl.int8)
        tl.store(cache_i8 + base + OFF_ROPE + row * R + r_idx, pq)
        tl.store(cache_f16 + (base + OFF_ROPE_SCALE) // 2 + row, pstep.to(tl.float16))


@triton.jit
def mla_stage_kernel(
    lat_ptr,
    lat_stride,
    pe_ptr,
    pe_stride,
    slot_ptr,
    pos_ptr,
    st_ptr,
    st_stride_slot,
    st_stride_row,
    RING,
    L: tl.constexpr,
    R: tl.constexpr,
):
    """One program per token: copy ``[latent | rope]`` to ``staging[slot, pos % RING]`` in the
    staging dtype (``slot < 0``: padding, nothing written)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = (tl.load(pos_ptr + t).to(tl.int64) % RING) * st_stride_row
        dst = st_ptr + slot * st_stride_slot + row
        c = tl.arange(0, L)
        tl.store(dst + c, tl.load(lat_ptr + t * lat_stride + c).to(st_ptr.dtype.element_ty))
        r = tl.arange(0, R)
        tl.store(dst + L + r, tl.load(pe_ptr + t * pe_stride + r).to(st_ptr.dtype.element_ty))


@triton.jit
def _load_rope(
    cache_i8,
    cache_f16,
    base,
    rows,
    R: tl.constexpr,
    OFF_ROPE: tl.constexpr,
    OFF_ROPE_SCALE: tl.constexpr,
):
    r = tl.arange(0, R)
    codes = tl.load(cache_i8 + base + OFF_ROPE + rows[:, None] * R + r[None, :]).to(tl.float32)
    scale = tl.load(cache_f16 + (base + OFF_ROPE_SCALE) // 2 + rows).to(tl.float32)
    return codes * scale[:, None]


@triton.jit
def mla_dequantize_kernel(
    cache_u8,
    cache_f16,
    cache_i8,
    cache_stride,
    block_ptr,
    out_ptr,
    out_stride,
    L: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OFF_CODES: tl.constexpr,
    OFF_SCALE: tl.constexpr,
    OFF_ZERO: tl.constexpr,
    OFF_ROPE: tl.constexpr,
    OFF_ROPE_SCALE: tl.constexpr,
):
    """Program ``(i, c)``: rows ``[c * BLOCK_T, (c + 1) * BLOCK_T)`` of block ``block_ids[i]``
    to ``out[i * G + row] = [latent | rope]`` in out's dtype."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    block = tl.load(block_ptr + i).to(tl.int64)
    base = block * cache_stride
    rows = c * BLOCK_T + tl.arange(0, BLOCK_T)
    NG: tl.constexpr = L // W
    w = tl.arange(0, W)
    dst = out_ptr + (i * G + rows[:, None]).to(tl.int64) * out_stride
    for g in tl.static_range(NG):
        code = latent_group(
            cache_u8, base, rows, g, L, BITS, W, BLOCK_T, OFF_CODES, 0, tl.float32, "", ""
        )
        step = tl.load(cache_f16 + (base + OFF_SCALE) // 2 + rows * NG + g).to(tl.float32)
        zero = tl.load(cache_f16 + (base + OFF_ZERO) // 2 + rows * NG + g).to(tl.float32)
        x = code * step[:, None] + zero[:, None]
        tl.store(dst + g * W + w[None, :], x.to(out_ptr.dtype.element_ty))
    pe = _load_rope(cache_i8, cache_f16, base, rows, R, OFF_ROPE, OFF_ROPE_SCALE)
    tl.store(dst + L + tl.arange(0, R)[None, :], pe.to(out_ptr.dtype.element_ty))
