"""Triton kernel: tile records back to dense K and V."""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import fwht_rows, log8_factor, round_to, unpack_rows

__all__ = ["dequantize_kernel"]


@triton.jit
def dequantize_kernel(
    cache_u8_ptr,
    cache_f16_ptr,
    stride_cb,
    stride_ch,
    block_ids_ptr,
    k_out_ptr,
    v_out_ptr,
    stride_ot,
    stride_oh,
    rsqrt_d,
    G: tl.constexpr,
    D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    OFF_FL: tl.constexpr,
    UNROTATE: tl.constexpr,
):
    """One program = one tile of one KV head -> ``G`` rows of ``k_out`` / ``v_out``.

    ``K[t, d] = (k_code[d, t] * k_scale[d] + k_zero[d]) * log8(k_token_scale[t])``,
    ``V[t, d] = (v_code[t, d] * v_scale[t] + v_zero[t]) * log8(v_channel_scale[d])``.
    Keys flagged ``KEYS_UNROTATED`` are in their own channels: rotated for a rotated output,
    left as they are for an un-rotated one.
    """
    i = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    rec = block * stride_cb + head.to(tl.int64) * stride_ch
    u8 = cache_u8_ptr + rec
    f16 = cache_f16_ptr + rec // 2
    g = tl.arange(0, G)
    d = tl.arange(0, D)

    k_codes = unpack_rows(u8 + OFF_KC, G * KEY_BITS // 8, D, G, KEY_BITS).to(tl.float32)  # [D, G]
    k_scale = tl.load(f16 + OFF_KS // 2 + d).to(tl.float32)
    k_zero = tl.load(f16 + OFF_KZ // 2 + d).to(tl.float32)
    k_tok = log8_factor(tl.load(u8 + OFF_KT + g))
    k = (k_codes * k_scale[:, None] + k_zero[:, None]) * k_tok[None, :]
    k = tl.trans(k)  # [G, D]

    v_codes = unpack_rows(u8 + OFF_VC, D * VALUE_BITS // 8, G, D, VALUE_BITS).to(tl.float32)
    v_chan = log8_factor(tl.load(u8 + OFF_VCS + d))
    v_scale = tl.load(f16 + OFF_VS // 2 + g).to(tl.float32)
    v_zero = tl.load(f16 + OFF_VZ // 2 + g).to(tl.float32)
    v = (v_codes * v_scale[:, None] + v_zero[:, None]) * v_chan[None, :]

    if UNROTATE:
        v = fwht_rows(v, G, D) * rsqrt_d
    # Keys are transformed only when the record's frame differs from the output's (a runtime
    # branch: a cache of rotated tiles read in the rotated frame skips it).
    raw = (tl.load(u8 + OFF_FL) & 1) != 0
    if raw != UNROTATE:
        k = fwht_rows(k, G, D) * rsqrt_d
    rows = (i * G + g).to(tl.int64)
    offs = rows[:, None] * stride_ot + head.to(tl.int64) * stride_oh + d[None, :]
    tl.store(k_out_ptr + offs, round_to(k, k_out_ptr.dtype.element_ty))
    tl.store(v_out_ptr + offs, round_to(v, v_out_ptr.dtype.element_ty))
