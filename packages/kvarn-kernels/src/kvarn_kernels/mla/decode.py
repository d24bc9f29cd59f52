"""Triton device code of the MLA latent decode (format: :mod:`kvarn_math.mla`), the ``fast``
kernel of ``KVARN_KERNELS_MLA_DECODE`` (not the default: see :mod:`kvarn_kernels.mla.verified`).

Absorbed-weight decode in latent space over quantized records plus an exact staged tail. The
latent is never dequantized element by element: with ``c[t, j] = code[t, j] * step[t, g] +
zero[t, g]`` (``g = j // W``, one step and zero per token and channel group), written about the
midpoint ``mid = zero + H * step`` (``H = 2^(BITS-1)``) as ``c = (code - H) * step + mid``,

    q . c[t]          = step[t, g] * (q_g . (code_g[t] - H)) + mid[t, g] * sum(q_g)
    sum_t p[t] c[t]_g = (p * step_g) @ (code_g - H) + sum_t p[t] mid[t, g]

so the tensor-core dots take the centred codes (small integers, exact in bf16/fp16/fp32) and
the steps and midpoints scale ``[heads, tokens]`` scores and weights. Codes become bf16 (fp16)
without an int-to-float conversion: a code ``x < 128`` OR-ed into the low mantissa bits of bf16
128 (``0x4300``; fp16 1024, ``0x6400``) reads as ``128 + x`` (``OFF``), and one exact
subtraction centres it.

Why centred, and why each chunk's midpoint part goes into the output accumulator at once: the
first version (``41c8ec1``) fed ``128 + code`` into the dots and kept ``sum p zero - 128 sum p
step`` in a separate accumulator, to cancel only at the end of the split. Both sums grow like
``128 * step`` (and ``zero``) times the split's weight while the output, a weighted mean of
mostly zero-mean values, stays small; their fp32 (tensor-core) rounding failed the GPU tests
(relative RMS up to 4.5e-2 in the tests, 1.1 at 128 heads x 32K in the benchmark, H100,
2026-12-06) where the interpreter's small cases passed. ``tests/test_kernels_mla_emulation.py``
models the GPU's rounding for both algebras.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["field_asm", "latent_group", "mla_decode_kernel", "mla_combine_kernel"]


@triton.jit
def _codes(raw, P: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """Bit field ``P`` of each byte as ``DOT_T``: the code (``MAGIC == 0``) or, with ``MAGIC``
    the bits of a float with unit spacing, that float plus the code."""
    c = (raw >> (P * BITS)) & ((1 << BITS) - 1)
    if MAGIC == 0:
        return c.to(tl.float32).to(DOT_T)
    else:
        return (c.to(tl.int16) | MAGIC).to(DOT_T, bitcast=True)


# Four packed bytes b0..b3 -> for each bit field, two registers of two 16-bit floats
# [MAGIC + field(b0), MAGIC + field(b1)] and [.. b2, .. b3]: a byte permute spreads the bytes to
# 16-bit lanes, then per field one shift and one AND-OR (lop3; 0xEA = (a & b) | c).
_SPREAD = """
    .reg .b32 t0, t1;
    prmt.b32 t0, $IN, 0, 0x4140;
    prmt.b32 t1, $IN, 0, 0x4342;
"""


def field_asm(bits: int, magic: int) -> tuple[str, str]:
    """PTX and constraints of the unpack of every ``bits``-wide field of 4 bytes (pack 4)."""
    per = 8 // bits
    mask = ((1 << bits) - 1) * 0x10001
    body = ["{", _SPREAD.replace("$IN", f"${2 * per}"), "    .reg .b32 u0, u1;"]
    for p in range(per):
        for half, (t, u) in enumerate((("t0", "u0"), ("t1", "u1"))):
            src = t
            if p:
                body.append(f"    shr.b32 {u}, {t}, {p * bits};")
                src = u
            body.append(
                f"    lop3.b32 ${2 * p + half}, {src}, {mask:#x}, {magic * 0x10001:#x}, 0xEA;"
            )
    body.append("}")
    return "\n".join(body), ",".join(["=r"] * (2 * per) + ["r"])


@triton.jit
def latent_group(
    cache_u8,
    base,
    rows,
    g,
    L: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OFF_CODES: tl.constexpr,
    MAGIC: tl.constexpr,
    DOT_T: tl.constexpr,
    ASM: tl.constexpr,
    ASM_C: tl.constexpr,
):
    """Codes of channels ``[g * W, (g + 1) * W)`` of record rows ``rows`` (``BLOCK_T`` of them):
    ``[BLOCK_T, W]`` in ``DOT_T``, channel order. Each byte is loaded once; its ``8 / BITS``
    fields (field ``p`` of byte ``k`` is channel ``PER * k + p``) come apart with Triton's shifts
    and masks, or with ``ASM`` (:func:`field_asm`: two fields a register; bf16/fp16 with
    ``MAGIC``, not in the interpreter), and are interleaved back with joins."""
    PER: tl.constexpr = 8 // BITS
    KG: tl.constexpr = W // PER
    kb = tl.arange(0, KG)
    raw = tl.load(cache_u8 + base + OFF_CODES + rows[:, None] * (L // PER) + g * KG + kb[None, :])
    if PER == 1:
        x = _codes(raw, 0, BITS, MAGIC, DOT_T)
    elif PER == 2:
        if ASM == "":
            f0 = _codes(raw, 0, BITS, MAGIC, DOT_T)
            f1 = _codes(raw, 1, BITS, MAGIC, DOT_T)
        else:
            f0, f1 = tl.inline_asm_elementwise(
                ASM, ASM_C, [raw], dtype=(DOT_T.value, DOT_T.value), is_pure=True, pack=4
            )
        x = tl.join(f0, f1)
    else:  # [k, a, b] = field 2a + b
        if ASM == "":
            f0 = _codes(raw, 0, BITS, MAGIC, DOT_T)
            f1 = _codes(raw, 1, BITS, MAGIC, DOT_T)
            f2 = _codes(raw, 2, BITS, MAGIC, DOT_T)
            f3 = _codes(raw, 3, BITS, MAGIC, DOT_T)
        else:
            f0, f1, f2, f3 = tl.inline_asm_elementwise(
                ASM, ASM_C, [raw], dtype=(DOT_T.value,) * 4, is_pure=True, pack=4
            )
        x = tl.join(tl.join(f0, f2), tl.join(f1, f3))
    return tl.reshape(x, (BLOCK_T, W))


@triton.jit
def _centre(x, SHIFT: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """``x - SHIFT`` in ``DOT_T`` (small integers: exact either way): in ``DOT_T`` after the
    exponent trick (bf16 on the GPU, fp16), through fp32 after an exact conversion (8-bit codes,
    fp32 queries, and bf16 in the interpreter, which has no bf16 constants)."""
    if MAGIC == 0:
        return (x.to(tl.float32) - SHIFT).to(DOT_T)
    else:
        return (x - SHIFT).to(DOT_T)


@triton.jit
def _dot(a, b, DOT_T: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 operands in IEEE precision (not TF32)."""
    if tl.float32 == DOT_T:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend(q0, q1, qpe, qs0, qs1, x0, x1, pe, step0, step1, mid0, mid1, pscale, valid, m, l_sum,
            a0, a1, scale, NG: tl.constexpr, DOT_T: tl.constexpr):  # fmt: skip
    """One online-softmax step (log2 domain) of ``HB`` heads over a chunk of keys.

    ``x{g}`` ``[T, W]``: centred codes (``code - 2^(BITS-1)``) of channel group ``g`` with
    per-token ``step{g}`` and midpoint ``mid{g}`` (``zero + 2^(BITS-1) * step``; the staged
    tail: exact values, step 1, midpoint 0); ``pe`` the RoPE codes with per-token ``pscale``;
    ``qs{g}`` the query's group sums. Carries the running max ``m``, sum ``l_sum`` and the
    output ``a{g}``, to which each chunk adds its midpoint part at once (nothing large is
    carried from chunk to chunk: see the module's docstring)."""
    s = _dot(qpe, tl.trans(pe), DOT_T) * pscale[None, :]
    s += _dot(q0, tl.trans(x0), DOT_T) * step0[None, :] + qs0[:, None] * mid0[None, :]
    if NG > 1:
        s += _dot(q1, tl.trans(x1), DOT_T) * step1[None, :] + qs1[:, None] * mid1[None, :]
    s = tl.where(valid[None, :], s * scale, -1.0e30)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    p = tl.where(valid[None, :], p, 0.0)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    p0 = (p * step0[None, :]).to(DOT_T)
    a0 = a0 * alpha[:, None] + _dot(p0, x0, DOT_T) + tl.sum(p * mid0[None, :], axis=1)[:, None]
    if NG > 1:
        p1 = (p * step1[None, :]).to(DOT_T)
        a1 = a1 * alpha[:, None] + _dot(p1, x1, DOT_T)
        a1 += tl.sum(p * mid1[None, :], axis=1)[:, None]
    return m_new, l_sum, a0, a1


@triton.jit
def _attend_t(q0, q1, qpe, qs0, qs1, x0, x1, pe, step0, step1, mid0, mid1, pscale, valid, m,
              l_sum, a0, a1, scale, NG: tl.constexpr, DOT_T: tl.constexpr):  # fmt: skip
    """:func:`_attend` transposed, tokens on the M side of the dots (``wgmma`` on sm_90, the
    codes its A operand, the query and weight columns the small B operand): ``q{g}`` ``[W,
    HB]``, ``qpe`` ``[R, HB]``, scores ``[T, HB]``, ``a{g}`` ``[W, HB]``."""
    s = _dot(pe, qpe, DOT_T) * pscale[:, None]
    s += _dot(x0, q0, DOT_T) * step0[:, None] + mid0[:, None] * qs0[None, :]
    if NG > 1:
        s += _dot(x1, q1, DOT_T) * step1[:, None] + mid1[:, None] * qs1[None, :]
    s = tl.where(valid[:, None], s * scale, -1.0e30)
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[None, :])
    p = tl.where(valid[:, None], p, 0.0)
    l_sum = l_sum * alpha + tl.sum(p, axis=0)
    p0 = (p * step0[:, None]).to(DOT_T)
    a0 = a0 * alpha[None, :] + _dot(tl.trans(x0), p0, DOT_T)
    a0 += tl.sum(p * mid0[:, None], axis=0)[None, :]
    if NG > 1:
        p1 = (p * step1[:, None]).to(DOT_T)
        a1 = a1 * alpha[None, :] + _dot(tl.trans(x1), p1, DOT_T)
        a1 += tl.sum(p * mid1[:, None], axis=0)[None, :]
    return m_new, l_sum, a0, a1


@triton.jit
def _step(q0, q1, qpe, qs0, qs1, x0, x1, pe, st0, st1, mi0, mi1, ps, valid, m, l_sum, a0, a1,
          scale, NG: tl.constexpr, DOT_T: tl.constexpr, TOKENS_M: tl.constexpr):  # fmt: skip
    """:func:`_attend_t` (``TOKENS_M``) or :func:`_attend`."""
    if TOKENS_M:
        return _attend_t(q0, q1, qpe, qs0, qs1, x0, x1, pe, st0, st1, mi0, mi1, ps, valid, m,
                         l_sum, a0, a1, scale, NG, DOT_T)  # fmt: skip
    else:
        return _attend(q0, q1, qpe, qs0, qs1, x0, x1, pe, st0, st1, mi0, mi1, ps, valid, m,
                       l_sum, a0, a1, scale, NG, DOT_T)  # fmt: skip


@triton.jit
def _row_scales(cache_f16, base, rows, g, NG: tl.constexpr, OFF_SCALE: tl.constexpr, OFF_ZERO,
                HALF: tl.constexpr):  # fmt: skip
    """Per-token step and midpoint ``zero + HALF * step`` of channel group ``g`` (float32
    ``[len(rows)]`` each)."""
    step = tl.load(cache_f16 + (base + OFF_SCALE) // 2 + rows * NG + g).to(tl.float32)
    zero = tl.load(cache_f16 + (base + OFF_ZERO) // 2 + rows * NG + g).to(tl.float32)
    return step, zero + HALF * step


@triton.jit
def mla_decode_kernel(
    ql_ptr,
    qpe_ptr,
    q_stride_b,
    q_stride_h,
    qpe_stride_b,
    qpe_stride_h,
    cache_u8,
    cache_f16,
    cache_i8,
    cache_stride,
    st_ptr,
    st_stride_slot,
    st_stride_row,
    table_ptr,
    table_stride,
    seq_lens_ptr,
    qlens_ptr,
    slots_ptr,
    ws_acc,
    ws_ml,
    min_tiles,
    sm_scale,
    H,
    RING,
    L: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OFF_CODES: tl.constexpr,
    OFF_SCALE: tl.constexpr,
    OFF_ZERO: tl.constexpr,
    OFF_ROPE: tl.constexpr,
    OFF_ROPE_SCALE: tl.constexpr,
    MAGIC: tl.constexpr,
    OFF: tl.constexpr,
    HALF: tl.constexpr,
    DOT_T: tl.constexpr,
    ASM: tl.constexpr,
    ASM_C: tl.constexpr,
    TOKENS_M: tl.constexpr,
):
    """Program ``(head block, split, b)``: partial attention of ``HB`` heads over split ``s`` of
    the sequence's tiles (``ceil(tiles / S)`` a split, at least ``min_tiles``), the quantized
    ones (positions ``< quantized_lens[b]``) in chunks of ``BLOCK_T`` record rows, each chunk's
    bytes loaded and unpacked once for all ``HB`` heads, the rest read exact from the staging
    ring. Head blocks of one split are neighbours in the launch order, so the others read a
    chunk from L2. Writes unnormalized partials ``ws_acc [B, H, S, L]`` and ``ws_ml [B, H, S,
    2]`` (log2 domain)."""
    hb = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)  # a launch value, not a constant: no recompile a count
    NG: tl.constexpr = L // W
    CPT: tl.constexpr = G // BLOCK_T
    heads = hb * HB + tl.arange(0, HB)
    hmask = heads < H
    w = tl.arange(0, W)
    r = tl.arange(0, R)
    q_b = ql_ptr + b.to(tl.int64) * q_stride_b
    qpe_b = qpe_ptr + b.to(tl.int64) * qpe_stride_b
    if TOKENS_M:  # query columns: [W, HB], [R, HB]; accumulators [W, HB]
        qcol = q_b + heads[None, :] * q_stride_h + w[:, None]
        q0 = tl.load(qcol, mask=hmask[None, :], other=0.0).to(DOT_T)
        q1 = q0
        if NG > 1:
            q1 = tl.load(qcol + W, mask=hmask[None, :], other=0.0).to(DOT_T)
        qs0 = tl.sum(q0.to(tl.float32), axis=0)
        qs1 = tl.sum(q1.to(tl.float32), axis=0)
        qpe = tl.load(
            qpe_b + heads[None, :] * qpe_stride_h + r[:, None], mask=hmask[None, :], other=0.0
        ).to(DOT_T)
        a0 = tl.zeros((W, HB), tl.float32)
    else:  # query rows: [HB, W], [HB, R]; accumulators [HB, W]
        qrow = q_b + heads[:, None] * q_stride_h + w[None, :]
        q0 = tl.load(qrow, mask=hmask[:, None], other=0.0).to(DOT_T)
        q1 = q0
        if NG > 1:
            q1 = tl.load(qrow + W, mask=hmask[:, None], other=0.0).to(DOT_T)
        qs0 = tl.sum(q0.to(tl.float32), axis=1)
        qs1 = tl.sum(q1.to(tl.float32), axis=1)
        qpe = tl.load(
            qpe_b + heads[:, None] * qpe_stride_h + r[None, :], mask=hmask[:, None], other=0.0
        ).to(DOT_T)
        a0 = tl.zeros((HB, W), tl.float32)
    scale = sm_scale * 1.4426950408889634  # log2(e)
    m = tl.full((HB,), -1.0e30, tl.float32)
    l_sum = tl.zeros((HB,), tl.float32)
    a1 = a0
    seq_len = tl.load(seq_lens_ptr + b)
    qlen = tl.load(qlens_ptr + b)
    # this sequence's tiles shared out over the splits (at least min_tiles a split, so a short
    # sequence leaves the last splits empty): from device lengths, the grid stays fixed
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, G), num_splits), min_tiles)
    t_lo = s * per_split
    t_hi = t_lo + per_split
    every = tl.full((BLOCK_T,), 1, tl.int1)
    table_row = table_ptr + b.to(tl.int64) * table_stride
    for j in range(t_lo * CPT, tl.minimum(t_hi, qlen // G) * CPT):
        base = tl.load(table_row + j // CPT).to(tl.int64) * cache_stride
        rows = (j % CPT) * BLOCK_T + tl.arange(0, BLOCK_T)
        # codes as DOT_T floats OFF + code, centred: code - HALF (small integers, exact)
        x0 = latent_group(
            cache_u8, base, rows, 0, L, BITS, W, BLOCK_T, OFF_CODES, MAGIC, DOT_T, ASM, ASM_C
        )
        x0 = _centre(x0, OFF + HALF, MAGIC, DOT_T)
        step0, mid0 = _row_scales(cache_f16, base, rows, 0, NG, OFF_SCALE, OFF_ZERO, HALF)
        x1 = x0
        step1 = step0
        mid1 = mid0
        if NG > 1:
            x1 = latent_group(
                cache_u8, base, rows, 1, L, BITS, W, BLOCK_T, OFF_CODES, MAGIC, DOT_T, ASM, ASM_C
            )
            x1 = _centre(x1, OFF + HALF, MAGIC, DOT_T)
            step1, mid1 = _row_scales(cache_f16, base, rows, 1, NG, OFF_SCALE, OFF_ZERO, HALF)
        pe = tl.load(cache_i8 + base + OFF_ROPE + rows[:, None] * R + r[None, :]).to(DOT_T)
        pscale = tl.load(cache_f16 + (base + OFF_ROPE_SCALE) // 2 + rows).to(tl.float32)
        m, l_sum, a0, a1 = _step(
            q0, q1, qpe, qs0, qs1, x0, x1, pe, step0, step1, mid0, mid1, pscale,
            every, m, l_sum, a0, a1, scale, NG, DOT_T, TOKENS_M,
        )  # fmt: skip
    # the staged tail: exact rows [latent | rope], step 1 and zero 0
    row_base = tl.load(slots_ptr + b).to(tl.int64) * st_stride_slot
    stop = tl.minimum(t_hi * G, seq_len)
    ones = tl.full((BLOCK_T,), 1.0, tl.float32)
    nil = tl.zeros((BLOCK_T,), tl.float32)
    # (not software-pipelined: at most a ring of rows, and its buffers would cost shared memory)
    for p0 in tl.range(tl.maximum(t_lo * G, qlen), stop, BLOCK_T, num_stages=1):
        pos = p0 + tl.arange(0, BLOCK_T)
        valid = pos < stop
        src = st_ptr + row_base + (pos % RING).to(tl.int64)[:, None] * st_stride_row
        x0 = tl.load(src + w[None, :], mask=valid[:, None], other=0.0).to(DOT_T)
        x1 = x0
        if NG > 1:
            x1 = tl.load(src + W + w[None, :], mask=valid[:, None], other=0.0).to(DOT_T)
        pe = tl.load(src + L + r[None, :], mask=valid[:, None], other=0.0).to(DOT_T)
        m, l_sum, a0, a1 = _step(
            q0, q1, qpe, qs0, qs1, x0, x1, pe, ones, ones, nil, nil, ones,
            valid, m, l_sum, a0, a1, scale, NG, DOT_T, TOKENS_M,
        )  # fmt: skip
    part = (b * H + heads).to(tl.int64) * num_splits + s
    if TOKENS_M:
        dst = ws_acc + part[None, :] * L + w[:, None]
        tl.store(dst, a0, mask=hmask[None, :])
        if NG > 1:
            tl.store(dst + W, a1, mask=hmask[None, :])
    else:
        dst = ws_acc + part[:, None] * L + w[None, :]
        tl.store(dst, a0, mask=hmask[:, None])
        if NG > 1:
            tl.store(dst + W, a1, mask=hmask[:, None])
    tl.store(ws_ml + part * 2, m, mask=hmask)
    tl.store(ws_ml + part * 2 + 1, l_sum, mask=hmask)


@triton.jit
def mla_combine_kernel(
    ws_acc,
    ws_ml,
    out_ptr,
    out_stride_b,
    out_stride_h,
    H,
    num_splits,
    L: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Program ``(b, h)``: merge the ``num_splits`` partials (``SPLITS_P2``: a power of two
    at least as large) into ``out[b, h]`` (zeros when the sequence has no key, e.g. CUDA-graph
    padding)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    smask = sp < num_splits
    part = (b * H + h).to(tl.int64) * num_splits + sp
    m = tl.load(ws_ml + part * 2, mask=smask, other=-1.0e30)
    l_sum = tl.load(ws_ml + part * 2 + 1, mask=smask, other=0.0)
    big = tl.max(m, axis=0)
    denom = tl.sum(tl.where(smask, tl.exp2(m - big), 0.0) * l_sum, axis=0)
    c = tl.arange(0, L)
    num = tl.zeros((L,), tl.float32)
    first = (b * H + h).to(tl.int64) * num_splits
    for k in range(num_splits):  # one split's row at a time: L floats live, not S * L
        wk = tl.exp2(tl.load(ws_ml + (first + k) * 2) - big)
        num += wk * tl.load(ws_acc + (first + k) * L + c)
    res = tl.div_rn(num, tl.maximum(denom, 1.0e-30))
    dst = out_ptr + b.to(tl.int64) * out_stride_b + h.to(tl.int64) * out_stride_h + c
    tl.store(dst, res.to(out_ptr.dtype.element_ty))
