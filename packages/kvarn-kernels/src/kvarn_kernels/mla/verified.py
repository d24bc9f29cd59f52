"""The MLA latent decode as GPU-verified on 2026-12-06 (H100: every MLA GPU test passed): the
default of :func:`kvarn_kernels.mla.mla_decode_attention` (``KVARN_KERNELS_MLA_DECODE=verified``).

This is the decode kernel of the commit before ``41c8ec1``, device code unchanged: each chunk of
record rows is dequantized once (``code * step + zero`` in fp32, per bit-field *plane*: channels
``P, P + PER, ...``) for all ``HB`` heads of a program, then rounded to the query's dtype for the
dots, so the accumulators hold values of the output's own size (no offset to cancel). The
redesigned kernel (:mod:`kvarn_kernels.mla.decode`, ``KVARN_KERNELS_MLA_DECODE=fast``) is faster
on the GPU but failed 7 of 32 GPU tests on 2026-12-06; its fix (centred codes) has not run
on a GPU yet (docs/mla.md).

:func:`launch_verified` takes arguments :func:`~kvarn_kernels.mla.mla_decode_attention` has
already checked; its splits are the morning's (about 264 programs, whole tiles a split, the
split count a compile-time constant).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels.mla.kernel import _load_rope

__all__ = [
    "launch_verified",
    "verified_splits",
    "verified_decode_kernel",
    "verified_combine_kernel",
]

_TARGET_PROGRAMS = 264  # about two waves of programs on a 132-SM H100


@triton.jit
def _load_plane(
    cache_u8,
    cache_f16,
    base,
    rows,
    P: tl.constexpr,
    L: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    OFF_CODES: tl.constexpr,
    OFF_SCALE: tl.constexpr,
    OFF_ZERO: tl.constexpr,
):
    """Plane ``P`` (channels ``P, P + PER, ...``) of record rows ``rows``: float32
    ``[len(rows), L / PER]``."""
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = L // W
    k = tl.arange(0, L // PER)
    raw = tl.load(cache_u8 + base + OFF_CODES + rows[:, None] * (L // PER) + k[None, :])
    code = ((raw.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    grp = (k * PER + P) // W
    step = tl.load(cache_f16 + (base + OFF_SCALE) // 2 + rows[:, None] * NG + grp[None, :])
    zero = tl.load(cache_f16 + (base + OFF_ZERO) // 2 + rows[:, None] * NG + grp[None, :])
    return code * step.to(tl.float32) + zero.to(tl.float32)


@triton.jit
def _dot(a, b, DOT_T: tl.constexpr):
    """``a @ b`` with fp32 accumulation; fp32 operands in IEEE precision (not TF32)."""
    if tl.float32 == DOT_T:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_chunk(
    q0,
    q1,
    q2,
    q3,
    qpe,
    x0,
    x1,
    x2,
    x3,
    pe,
    valid,
    m,
    l_sum,
    a0,
    a1,
    a2,
    a3,
    sm_scale,
    PER: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """One online-softmax step over a chunk of keys (planes ``x0..x{PER-1}``, RoPE ``pe``)."""
    s = _dot(qpe, tl.trans(pe.to(DOT_T)), DOT_T)
    s += _dot(q0, tl.trans(x0.to(DOT_T)), DOT_T)
    if PER > 1:
        s += _dot(q1, tl.trans(x1.to(DOT_T)), DOT_T)
    if PER > 2:
        s += _dot(q2, tl.trans(x2.to(DOT_T)), DOT_T)
        s += _dot(q3, tl.trans(x3.to(DOT_T)), DOT_T)
    s = tl.where(valid[None, :], s * sm_scale, -1.0e30)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    p = tl.where(valid[None, :], p, 0.0)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    pd = p.to(DOT_T)
    a0 = a0 * alpha[:, None] + _dot(pd, x0.to(DOT_T), DOT_T)
    if PER > 1:
        a1 = a1 * alpha[:, None] + _dot(pd, x1.to(DOT_T), DOT_T)
    if PER > 2:
        a2 = a2 * alpha[:, None] + _dot(pd, x2.to(DOT_T), DOT_T)
        a3 = a3 * alpha[:, None] + _dot(pd, x3.to(DOT_T), DOT_T)
    return m_new, l_sum, a0, a1, a2, a3


@triton.jit
def _load_stage_plane(
    st_ptr, row_base, ring_rows, valid, P: tl.constexpr, L: tl.constexpr, PER: tl.constexpr
):
    k = tl.arange(0, L // PER)
    ptrs = st_ptr + row_base + ring_rows[:, None] + (k * PER + P)[None, :]
    return tl.load(ptrs, mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def verified_decode_kernel(
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
    tiles_per_split,
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
    NUM_SPLITS: tl.constexpr,
    OFF_CODES: tl.constexpr,
    OFF_SCALE: tl.constexpr,
    OFF_ZERO: tl.constexpr,
    OFF_ROPE: tl.constexpr,
    OFF_ROPE_SCALE: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """Program ``(b, head block, split)``: partial attention of ``HB`` heads over the split's
    tiles ``[s * tiles_per_split, (s + 1) * tiles_per_split)``: the quantized ones (positions
    ``< quantized_lens[b]``) dequantized once per chunk for all ``HB`` heads, the rest read
    exact from the staging ring. Writes unnormalized ``acc`` and ``(m, l)`` (log2 domain)."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    PER: tl.constexpr = 8 // BITS
    heads = hb * HB + tl.arange(0, HB)
    hmask = heads < H
    k = tl.arange(0, L // PER)
    qrow = ql_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h
    q0 = tl.load(qrow + (k * PER)[None, :], mask=hmask[:, None], other=0.0).to(DOT_T)
    q1 = q0
    q2 = q0
    q3 = q0
    if PER > 1:
        q1 = tl.load(qrow + (k * PER + 1)[None, :], mask=hmask[:, None], other=0.0).to(DOT_T)
    if PER > 2:
        q2 = tl.load(qrow + (k * PER + 2)[None, :], mask=hmask[:, None], other=0.0).to(DOT_T)
        q3 = tl.load(qrow + (k * PER + 3)[None, :], mask=hmask[:, None], other=0.0).to(DOT_T)
    r = tl.arange(0, R)
    qpe = tl.load(
        qpe_ptr + b.to(tl.int64) * qpe_stride_b + heads[:, None] * qpe_stride_h + r[None, :],
        mask=hmask[:, None],
        other=0.0,
    ).to(DOT_T)
    scale = sm_scale * 1.4426950408889634
    m = tl.full((HB,), -1.0e30, tl.float32)
    l_sum = tl.zeros((HB,), tl.float32)
    a0 = tl.zeros((HB, L // PER), tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    seq_len = tl.load(seq_lens_ptr + b)
    qlen = tl.load(qlens_ptr + b)
    t_lo = s * tiles_per_split
    t_hi = t_lo + tiles_per_split
    all_rows = tl.full((BLOCK_T,), 1, tl.int1)
    for ti in range(t_lo, tl.minimum(t_hi, qlen // G)):
        block = tl.load(table_ptr + b.to(tl.int64) * table_stride + ti).to(tl.int64)
        base = block * cache_stride
        for c in range(G // BLOCK_T):
            rows = c * BLOCK_T + tl.arange(0, BLOCK_T)
            x0 = _load_plane(
                cache_u8, cache_f16, base, rows, 0, L, BITS, W, OFF_CODES, OFF_SCALE, OFF_ZERO
            )
            x1 = x0
            x2 = x0
            x3 = x0
            if PER > 1:
                x1 = _load_plane(
                    cache_u8, cache_f16, base, rows, 1, L, BITS, W, OFF_CODES, OFF_SCALE, OFF_ZERO
                )
            if PER > 2:
                x2 = _load_plane(
                    cache_u8, cache_f16, base, rows, 2, L, BITS, W, OFF_CODES, OFF_SCALE, OFF_ZERO
                )
                x3 = _load_plane(
                    cache_u8, cache_f16, base, rows, 3, L, BITS, W, OFF_CODES, OFF_SCALE, OFF_ZERO
                )
            pe = _load_rope(cache_i8, cache_f16, base, rows, R, OFF_ROPE, OFF_ROPE_SCALE)
            m, l_sum, a0, a1, a2, a3 = _attend_chunk(
                q0,
                q1,
                q2,
                q3,
                qpe,
                x0,
                x1,
                x2,
                x3,
                pe,
                all_rows,
                m,
                l_sum,
                a0,
                a1,
                a2,
                a3,
                scale,
                PER,
                DOT_T,
            )
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row_base = slot * st_stride_slot
    start = tl.maximum(t_lo * G, qlen)
    stop = tl.minimum(t_hi * G, seq_len)
    for p0 in range(start, stop, BLOCK_T):
        pos = p0 + tl.arange(0, BLOCK_T)
        valid = pos < stop
        ring = (pos % RING).to(tl.int64) * st_stride_row
        x0 = _load_stage_plane(st_ptr, row_base, ring, valid, 0, L, PER)
        x1 = x0
        x2 = x0
        x3 = x0
        if PER > 1:
            x1 = _load_stage_plane(st_ptr, row_base, ring, valid, 1, L, PER)
        if PER > 2:
            x2 = _load_stage_plane(st_ptr, row_base, ring, valid, 2, L, PER)
            x3 = _load_stage_plane(st_ptr, row_base, ring, valid, 3, L, PER)
        pe = tl.load(
            st_ptr + row_base + ring[:, None] + L + r[None, :], mask=valid[:, None], other=0.0
        ).to(tl.float32)
        m, l_sum, a0, a1, a2, a3 = _attend_chunk(
            q0,
            q1,
            q2,
            q3,
            qpe,
            x0,
            x1,
            x2,
            x3,
            pe,
            valid,
            m,
            l_sum,
            a0,
            a1,
            a2,
            a3,
            scale,
            PER,
            DOT_T,
        )
    # partials: ws_acc [B, H, S, L] in natural channel order, ws_ml [B, H, S, 2]
    part = (b * H + heads).to(tl.int64) * NUM_SPLITS + s
    dst = ws_acc + part[:, None] * L
    tl.store(dst + (k * PER)[None, :], a0, mask=hmask[:, None])
    if PER > 1:
        tl.store(dst + (k * PER + 1)[None, :], a1, mask=hmask[:, None])
    if PER > 2:
        tl.store(dst + (k * PER + 2)[None, :], a2, mask=hmask[:, None])
        tl.store(dst + (k * PER + 3)[None, :], a3, mask=hmask[:, None])
    tl.store(ws_ml + part * 2, m, mask=hmask)
    tl.store(ws_ml + part * 2 + 1, l_sum, mask=hmask)


@triton.jit
def verified_combine_kernel(
    ws_acc,
    ws_ml,
    out_ptr,
    out_stride_b,
    out_stride_h,
    H,
    L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Program ``(b, h)``: merge the splits' partials into ``out[b, h]`` (zeros when the
    sequence has no key, e.g. CUDA-graph padding)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    smask = sp < NUM_SPLITS
    part = (b * H + h).to(tl.int64) * NUM_SPLITS + sp
    m = tl.load(ws_ml + part * 2, mask=smask, other=-1.0e30)
    l_sum = tl.load(ws_ml + part * 2 + 1, mask=smask, other=0.0)
    big = tl.max(m, axis=0)
    denom = tl.sum(tl.where(smask, tl.exp2(m - big), 0.0) * l_sum, axis=0)
    c = tl.arange(0, L)
    num = tl.zeros((L,), tl.float32)
    first = (b * H + h).to(tl.int64) * NUM_SPLITS
    for k in range(NUM_SPLITS):  # one split's row at a time: L floats live, not S * L
        w = tl.exp2(tl.load(ws_ml + (first + k) * 2) - big)
        num += w * tl.load(ws_acc + (first + k) * L + c)
    res = tl.div_rn(num, tl.maximum(denom, 1.0e-30))
    dst = out_ptr + b.to(tl.int64) * out_stride_b + h.to(tl.int64) * out_stride_h + c
    tl.store(dst, res.to(out_ptr.dtype.element_ty))


def verified_splits(batch: int, head_blocks: int, max_tiles: int) -> int:
    """The verified kernel's split-K factor from host sizes only (a captured graph keeps it):
    enough programs to fill the GPU, at least one tile per split, at most 64 splits."""
    want = max(1, _TARGET_PROGRAMS // max(1, batch * head_blocks))
    return max(1, min(want, max_tiles, 64))


def launch_verified(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    staging: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    staging_slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    offsets: dict[str, int],
    latent_bits: int,
    channel_group: int,
    group_size: int,
    dot_type: tl.dtype,
    num_splits: int | None,
    heads_per_program: int,
) -> torch.Tensor:
    """Launch the verified decode and combine kernels into ``out`` ``[B, H, L]`` (shapes as
    :func:`~kvarn_kernels.mla.mla_decode_attention` checked them; ``heads_per_program`` a
    power of two >= 16, ``num_splits`` ``None`` for :func:`verified_splits`)."""
    bsz, heads, width = q_latent.shape
    rdim = q_rope.shape[2]
    hb = heads_per_program
    head_blocks = -(-heads // hb)
    max_tiles = block_table.shape[1]
    splits = num_splits or verified_splits(bsz, head_blocks, max_tiles)
    per_split = -(-max(max_tiles, 1) // splits)
    ws_acc = torch.empty((bsz, heads, splits, width), dtype=torch.float32, device=cache.device)
    ws_ml = torch.empty((bsz, heads, splits, 2), dtype=torch.float32, device=cache.device)
    verified_decode_kernel[(bsz, head_blocks, splits)](
        q_latent,
        q_rope,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache,
        cache.view(torch.float16),
        cache.view(torch.int8),
        cache.stride(0),
        staging,
        staging.stride(0),
        staging.stride(1),
        block_table,
        block_table.stride(0),
        seq_lens,
        quantized_lens,
        staging_slots,
        ws_acc,
        ws_ml,
        per_split,
        float(scale),
        heads,
        staging.shape[1],
        L=width,
        R=rdim,
        G=group_size,
        BITS=latent_bits,
        W=channel_group,
        HB=hb,
        BLOCK_T=32 if latent_bits < 8 else 16,
        NUM_SPLITS=splits,
        DOT_T=dot_type,
        **offsets,
        num_warps=4 if hb <= 16 else 8,
    )
    verified_combine_kernel[(bsz, heads)](
        ws_acc,
        ws_ml,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        L=width,
        NUM_SPLITS=splits,
        SPLITS_P2=max(2, 1 << (splits - 1).bit_length()),
        num_warps=4,
    )
    return out
