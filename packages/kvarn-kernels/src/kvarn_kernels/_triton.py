"""Triton building blocks shared by the ops: Walsh-Hadamard butterflies, bit (un)packing, math.

Everything here is ``@triton.jit`` device code or a host constant; nothing touches CUDA at import.
"""

from __future__ import annotations

import os

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels import settings

try:  # libdevice gives correctly rounded exp/log/rint on the GPU; the interpreter lacks it
    from triton.language.extra import libdevice  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - every supported Triton has it
    libdevice = None

__all__ = [
    "INTERPRET",
    "PRECISE_MATH",
    "exp2_f32",
    "exp_f32",
    "fwht_rows",
    "load_packed",
    "log2_f32",
    "log8_encode",
    "log8_factor",
    "log_f32",
    "pack_rows",
    "rint_f32",
    "round_to",
    "staging_rows",
    "unit_rows",
    "unpack_crumbs",
    "unpack_loaded",
    "unpack_nibbles",
    "unpack_rows",
]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Use libdevice's exp/log/rint when compiling for the GPU (closest to NumPy); the interpreter
# runs NumPy's own functions through tl.exp/tl.log, and the magic-number rint is exact there.
PRECISE_MATH = (not INTERPRET) and libdevice is not None
_INTERP: tl.constexpr = tl.constexpr(INTERPRET)
# PTX unpacking (unpack_nibbles / unpack_crumbs) on the GPU; KVARN_KERNELS_NO_ASM=1
# falls back to the portable bit operations (same results), e.g. to rule the asm out.
_ASM_UNPACK: tl.constexpr = tl.constexpr(not INTERPRET and not settings.current().no_asm)


@triton.jit
def _butterfly(x, R: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    # One radix-2 stage with half-width H on every row: (a, b) -> (a + b, a - b), the same
    # operations in the same order as kvarn_math.hadamard.fwht, so fp32 results are bit-exact.
    x4 = tl.reshape(x, [R, D // (2 * H), 2, H])
    x4 = tl.permute(x4, (0, 1, 3, 2))
    a, b = tl.split(x4)
    y = tl.join(a + b, a - b)
    y = tl.permute(y, (0, 1, 3, 2))
    return tl.reshape(y, [R, D])


@triton.jit
def fwht_rows(x, R: tl.constexpr, D: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of every row of ``x`` ``[R, D]`` (fp32), D <= 512."""
    if D > 1:
        x = _butterfly(x, R, D, 1)
    if D > 2:
        x = _butterfly(x, R, D, 2)
    if D > 4:
        x = _butterfly(x, R, D, 4)
    if D > 8:
        x = _butterfly(x, R, D, 8)
    if D > 16:
        x = _butterfly(x, R, D, 16)
    if D > 32:
        x = _butterfly(x, R, D, 32)
    if D > 64:
        x = _butterfly(x, R, D, 64)
    if D > 128:
        x = _butterfly(x, R, D, 128)
    if D > 256:
        x = _butterfly(x, R, D, 256)
    return x


@triton.jit
def unit_rows(x):
    """``(x / amax, amax)`` for rows ``x`` ``[R, D]`` (fp32), ``amax`` each row's largest
    magnitude (1 for an all-zero row): query rows with ``|x| <= 1``, so that products with fp16
    scales fit fp16, their scale applied after."""
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.where(amax > 0, amax, 1.0)
    return x / amax[:, None], amax


@triton.jit
def exp_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def log2_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log2(x)
    else:
        return tl.log2(x)


@triton.jit
def exp2_f32(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def log8_factor(codes, PRECISE: tl.constexpr = False):
    """kvarn_math.log8.decode_log8 of log8 codes: ``2^(n/16 - 1)`` fp32. The exponent is
    exact; the fast ``exp2`` is within 2 ulp of NumPy's, enough for attention, and the store
    (which must round like kvarn-math) passes ``PRECISE``."""
    return exp2_f32(codes.to(tl.float32) * 0.0625 - 1.0, PRECISE)


@triton.jit
def log8_encode(factor, PRECISE: tl.constexpr):
    """kvarn_math.log8.encode_log8 of positive fp32 factors, as int32 codes 0..255."""
    n = rint_f32(16.0 * log2_f32(factor, PRECISE), PRECISE) + 16.0
    return tl.minimum(tl.maximum(n, 0.0), 255.0).to(tl.int32)


@triton.jit
def rint_f32(x, PRECISE: tl.constexpr):
    """Round half to even (valid for |x| < 2**22 on the interpreter path)."""
    if PRECISE:
        return libdevice.rint(x)
    else:
        return (x + 12582912.0) - 12582912.0


@triton.jit
def load_packed(ptr, row_stride, mask, ROWS: tl.constexpr, LEN: tl.constexpr, BITS: tl.constexpr):
    """Issue the loads of ``ROWS`` packed rows of ``LEN`` ``BITS``-bit codes (see unpack_loaded).

    Split from the unpacking so a loop can prefetch the next step's bytes while computing.
    For 1/2/4/8 bits: uint8 ``[ROWS, LEN * BITS / 8]`` (one contiguous, vectorizable load per
    row).  Other widths: the ``BITS`` bytes of each group of 8 codes, ``[ROWS, LEN / 8, P]`` with
    ``P`` the next power of two (the extra bytes masked to 0).
    """
    rows = tl.arange(0, ROWS)[:, None]
    if (BITS == 1) or (BITS == 2) or (BITS == 4) or (BITS == 8):
        cols = tl.arange(0, LEN * BITS // 8)[None, :]
        return tl.load(ptr + rows * row_stride + cols, mask=mask, other=0)
    else:
        P: tl.constexpr = 4 if BITS <= 4 else 8
        grp = tl.arange(0, LEN // 8)[None, :, None]
        byte = tl.arange(0, P)[None, None, :]
        offs = rows[:, :, None] * row_stride + grp * BITS + byte
        return tl.load(ptr + offs, mask=mask & (byte < BITS), other=0)


@triton.jit
def unpack_loaded(raw, ROWS: tl.constexpr, LEN: tl.constexpr, BITS: tl.constexpr):
    """Codes int32 ``[ROWS, LEN]`` (natural order) from :func:`load_packed`'s bytes.

    Packing (kvarn_math.packing): code ``i`` of a group of 8 sits at bit ``BITS * i`` of the
    group's little-endian ``BITS``-byte word; for 1/2/4/8 bits a byte holds whole codes.
    """
    if BITS == 8:
        return raw.to(tl.int32)
    elif (BITS == 1) or (BITS == 2) or (BITS == 4):
        PER: tl.constexpr = 8 // BITS
        shifts = tl.arange(0, PER) * BITS
        codes = (raw.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes, [ROWS, LEN])
    else:
        P: tl.constexpr = 4 if BITS <= 4 else 8
        byte_shift = (tl.arange(0, P) * 8).to(tl.int64)
        word = tl.sum(raw.to(tl.int64) << byte_shift[None, None, :], axis=2)  # [ROWS, LEN/8]
        shifts = (tl.arange(0, 8) * BITS).to(tl.int64)
        codes = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes.to(tl.int32), [ROWS, LEN])


@triton.jit
def unpack_rows(ptr, row_stride, ROWS: tl.constexpr, LEN: tl.constexpr, BITS: tl.constexpr):
    """Load and unpack ``ROWS`` packed rows -> int32 ``[ROWS, LEN]``."""
    return unpack_loaded(load_packed(ptr, row_stride, True, ROWS, LEN, BITS), ROWS, LEN, BITS)


@triton.jit
def pack_rows(codes, ptr, row_stride, ROWS: tl.constexpr, LEN: tl.constexpr, BITS: tl.constexpr):
    """Store int32 codes ``[ROWS, LEN]`` packed as kvarn_math.packing does.

    The regrouping reshape goes through shared memory, so it works on the narrowest integers
    that hold the result: whole bytes in int16 when codes do not straddle bytes (1, 2, 4 or 8
    bits; a 128 x 256 tile then needs 64 KiB rather than the 256 KiB an int64 regroup takes,
    more than an SM has), else 8-code words (3 bytes in int32 for 3 bits).
    """
    rows = tl.arange(0, ROWS)[:, None]
    if 8 % BITS == 0:
        PER: tl.constexpr = 8 // BITS  # codes per byte
        NB: tl.constexpr = LEN // PER
        grouped = tl.reshape(codes.to(tl.int16), [ROWS, NB, PER])
        shifts = (tl.arange(0, PER) * BITS).to(tl.int16)
        byte = tl.sum(grouped << shifts[None, None, :], axis=2)  # disjoint bits: sum == or
        tl.store(ptr + rows * row_stride + tl.arange(0, NB)[None, :], byte.to(tl.uint8))
    else:
        NG: tl.constexpr = LEN // 8
        if BITS <= 4:
            grouped = tl.reshape(codes, [ROWS, NG, 8])
            shifts = tl.arange(0, 8) * BITS
        else:
            grouped = tl.reshape(codes.to(tl.int64), [ROWS, NG, 8])
            shifts = (tl.arange(0, 8) * BITS).to(tl.int64)
        word = tl.sum(grouped << shifts[None, None, :], axis=2)
        groups = tl.arange(0, NG)[None, :]
        for i in tl.static_range(BITS):
            byte = ((word >> (8 * i)) & 255).to(tl.uint8)
            tl.store(ptr + rows * row_stride + groups * BITS + i, byte)


@triton.jit
def _max_min(a_max, a_min, b_max, b_min):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)


@triton.jit
def extremes(x, AXIS: tl.constexpr):
    """``(max, min)`` of ``x`` along ``AXIS``. Compiled, in one reduction: one pass through
    shared memory and its barriers where the axis spans warps, instead of two. Triton's
    interpreter runs a custom combine element by element in Python (the store's CPU tests took
    112 s instead of 10), so there it takes ``tl.max`` and ``tl.min``: the same values, both
    being exact."""
    if _INTERP:
        return tl.max(x, axis=AXIS), tl.min(x, axis=AXIS)
    else:
        return tl.reduce((x, x), AXIS, _max_min)


@triton.jit
def fp16_operand(x):
    """``x`` as an fp16 dot operand, saturated to +-65504: bf16 staging and fresh K/V hold
    values past fp16's range (a rotated token reaches ``sqrt(D)`` x its largest channel), which
    a plain cast turns into infinities and the dot into NaN (H200, 2026-12-03: bf16 tokens of
    +-65504 gave a NaN attention output)."""
    if x.dtype == tl.float16:
        return x
    else:
        # In fp32: a bf16 clamp would round 65504 up to 65536.
        y = x.to(tl.float32)
        return tl.minimum(tl.maximum(y, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``, nearest even (as the GPU's cast does); fp16 saturates.

    The interpreter's plain fp32 -> bf16 cast truncates, so there the rounding is done on the bits.
    """
    if dtype == tl.float32:
        return x
    elif dtype == tl.float16:
        # Saturate: a rotated fp16 token can exceed the fp16 range (up to sqrt(D) x its max).
        return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(dtype)
    elif _INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def staging_rows(pos, SG: tl.constexpr, SINK_ROWS: tl.constexpr):
    """Staging row of position ``pos``: rows ``[0, SINK_ROWS)`` hold tile 0 for good (the exact
    attention sink, when the engine keeps one), the ring of ``SG = S*G`` rows after them the
    open (and uncommitted) tiles: ``SINK_ROWS + (pos - SINK_ROWS) % SG``."""
    if SINK_ROWS > 0:
        return tl.where(pos < SINK_ROWS, pos, SINK_ROWS + (pos - SINK_ROWS) % SG)
    else:
        return pos % SG


# Unpacking on 32-bit words (GPU): four packed bytes per register; PRMT spreads two of them into
# the 16-bit lanes, one AND/OR (a LOP3) per lane pair gives two fp16 values at once: 0x6400 is
# 1024.0 and the code fills its mantissa, so each lane is exactly ``1024 + code``, and one packed
# subtraction leaves the exact code.
_NIBBLES_ASM = tl.constexpr(
    """
{
.reg .b32 t0, t1, u0, u1, k;
mov.b32 k, 0x64006400;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.u32 u0, t0, 4;
shr.u32 u1, t1, 4;
and.b32 t0, t0, 0x000F000F;
and.b32 t1, t1, 0x000F000F;
and.b32 u0, u0, 0x000F000F;
and.b32 u1, u1, 0x000F000F;
or.b32 t0, t0, k;
or.b32 t1, t1, k;
or.b32 u0, u0, k;
or.b32 u1, u1, k;
sub.f16x2 $0, t0, k;
sub.f16x2 $1, t1, k;
sub.f16x2 $2, u0, k;
sub.f16x2 $3, u1, k;
}
"""
)

_CRUMBS_ASM = tl.constexpr(
    """
{
.reg .b32 t0, t1, u0, u1, k;
mov.b32 k, 0x64006400;
prmt.b32 t0, $8, 0, 0x4140;
prmt.b32 t1, $8, 0, 0x4342;
and.b32 u0, t0, 0x00030003;
and.b32 u1, t1, 0x00030003;
or.b32 u0, u0, k;
sub.f16x2 $0, u0, k;
or.b32 u1, u1, k;
sub.f16x2 $1, u1, k;
shr.u32 u0, t0, 2;
shr.u32 u1, t1, 2;
and.b32 u0, u0, 0x00030003;
and.b32 u1, u1, 0x00030003;
or.b32 u0, u0, k;
sub.f16x2 $2, u0, k;
or.b32 u1, u1, k;
sub.f16x2 $3, u1, k;
shr.u32 u0, t0, 4;
shr.u32 u1, t1, 4;
and.b32 u0, u0, 0x00030003;
and.b32 u1, u1, 0x00030003;
or.b32 u0, u0, k;
sub.f16x2 $4, u0, k;
or.b32 u1, u1, k;
sub.f16x2 $5, u1, k;
shr.u32 u0, t0, 6;
shr.u32 u1, t1, 6;
and.b32 u0, u0, 0x00030003;
and.b32 u1, u1, 0x00030003;
or.b32 u0, u0, k;
sub.f16x2 $6, u0, k;
or.b32 u1, u1, k;
sub.f16x2 $7, u1, k;
}
"""
)


@triton.jit
def _codes_f16(codes):
    """Small non-negative integer codes (int16, < 1024) to fp16, exactly (via ``1024 + code``)."""
    return (codes | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def unpack_nibbles(raw):
    """uint8 bytes -> ``(low nibble, high nibble)`` as fp16, elementwise."""
    if not _ASM_UNPACK:
        x = raw.to(tl.int16)
        return _codes_f16(x & 15), _codes_f16(x >> 4)
    else:
        return tl.inline_asm_elementwise(
            asm=_NIBBLES_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[raw],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )


@triton.jit
def unpack_crumbs(raw):
    """uint8 bytes -> the four 2-bit fields (bits 0-1 first) as fp16, elementwise."""
    if not _ASM_UNPACK:
        x = raw.to(tl.int16)
        return (
            _codes_f16(x & 3),
            _codes_f16((x >> 2) & 3),
            _codes_f16((x >> 4) & 3),
            _codes_f16(x >> 6),
        )
    else:
        return tl.inline_asm_elementwise(
            asm=_CRUMBS_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[raw],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
