"""Decode attention over the quantized tiles, tile by tile, tokens as the long side of the dots.

``tiles_decode_partial_kernel`` is the Triton counterpart of the Gluon kernel of
:mod:`kvarn_kernels.attention.fast`, for every preset with 1/2/4/8-bit values, head_dim 64, 128
and 256, and sliding windows: one program per (sequence, KV head, split) attends the quantized
tiles ``[first, quantized_len / G)`` of its split (``first`` = 1 where the sink rows replace tile
0; with a sliding window, from the tile of the window's first position), a whole tile of ``G``
tokens per iteration, and writes the partial layout of ``attention_partial_kernel``, which
attends the sink rows and staging (``QUANT=False``) beside it; the combine kernel merges both.

The difference to ``attention_partial_kernel``'s quantized loop is the orientation of the dots.
That loop puts the (padded) query rows on the M side of ``tl.dot``: 16 rows against 128 tokens,
so the GPU runs ``mma.sync`` with the unpacked codes as its B operand, which Triton stages
through shared memory every step. Here the scores are computed transposed,
``S^T [G, N] = codes^T [G, D] @ q^T [D, N]`` and ``O^T [D, N] += V^T [D, G] @ P^T [G, N]``: the
tile's tokens (or channels) are M, a multiple of 64, and the ``N = 16`` query rows of the GQA
group are N. On sm_90 Triton then emits ``wgmma`` (the codes as the register or shared-memory A
operand, the query and probability columns as the small B operand), and the per-query vectors
(running max, denominator) are rows of ``N`` columns. Compiled for sm_90 on the CPU
(kvarn_k4v2_g128, head_dim 128, 4 warps): 1,406 SASS instructions per warp and tile in the loop,
191 registers, wgmma for every dot (``tests/sm90_compile.py tiles``); not yet timed on a GPU.

Query rows come prepared (:func:`kvarn_kernels.attention.prep.prepare_queries`: rotated, scaled by
``scale * log2(e)``, divided by their largest entry, fp16; a second frame for tiles whose keys are
stored in their own channels). With the record's scale folding (see ``kernel.py``)::

    s[t, m] = k_tok[t] * a[m] * (sum_d code[d, t] (q[m, d] k_scale[d]) + sum_d q[m, d] k_zero[d])
    o[d, m] += v_chan[d] * (sum_t vcode[t, d] (p[t, m] v_scale[t]) + sum_t p[t, m] v_zero[t])

4-bit keys are scored by nibble halves (the even and odd tokens of a key byte, as the other
kernels do); other widths are unpacked into token order. 1/2/4-bit value codes are unpacked per
bit offset and interleaved into channel order in registers.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from kvarn_math.layout import TileLayout

from kvarn_kernels._format import offset_constants
from kvarn_kernels._triton import (
    load_packed,
    log8_factor,
    unpack_crumbs,
    unpack_loaded,
    unpack_nibbles,
)

__all__ = [
    "TILES_N",
    "launch_tiles_decode",
    "tiles_decode_partial_kernel",
    "tiles_launch",
    "tiles_splitting",
]

TILES_N = 16
"""Query columns of a program (the GQA group, padded): the N side of the dots."""

_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _packed_codes(raw, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """fp16 codes ``[G, D]`` in order from the packed rows ``raw`` ``[G, D*BITS/8]`` of 1/2/4/8-bit
    codes (code ``PER * n + k`` at bit ``BITS * k`` of byte ``n``): value rows, or 2-bit key
    channels."""
    if BITS == 4:
        lo, hi = unpack_nibbles(raw)
        return tl.reshape(tl.join(lo, hi), [G, D])
    elif BITS == 2:
        a0, a1, a2, a3 = unpack_crumbs(raw)
        return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [G, D])
    else:
        return unpack_loaded(raw, G, D, BITS).to(tl.float16)


@triton.jit
def _scales(q, f16, D: tl.constexpr, OFF_KS: tl.constexpr, OFF_KZ: tl.constexpr):
    """The query columns ``q`` ``[D, N]`` (fp32, ``|q| <= 1``) times the tile's key channel
    scales, as the fp16 dot operand, and their inner products with the zero points ``[N]``."""
    d = tl.arange(0, D)
    ks = tl.load(f16 + OFF_KS // 2 + d).to(tl.float32)
    kz = tl.load(f16 + OFF_KZ // 2 + d).to(tl.float32)
    return (q * ks[:, None]).to(tl.float16), tl.sum(q * kz[:, None], axis=0)


@triton.jit
def _finish(s, bias, amax, u8, tok, pos, w_lo, OFF_KT: tl.constexpr):
    """Raw dot products ``s`` ``[R, N]`` of the tokens ``tok`` ``[R]`` (at positions ``pos``) ->
    scores in log2 units; positions before ``w_lo`` (the window's start) are -inf."""
    scale = log8_factor(tl.load(u8 + OFF_KT + tok))
    s = (s + bias[None, :]) * (scale[:, None] * amax[None, :])
    return tl.where((pos >= w_lo)[:, None], s, float("-inf"))


@triton.jit
def _values(
    p,
    tok,
    u8,
    f16,
    R: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
):
    """``(V^T P^T [D, N], p * v_zero [R, N])`` of the probabilities ``p`` ``[R, N]`` of the
    tokens ``tok`` ``[R]`` (``p <= 1``), before the value channel scales; the caller sums the
    zero-point terms over the tokens."""
    NBV: tl.constexpr = D * BITS // 8
    raw = tl.load(u8 + OFF_VC + tok[:, None] * NBV + tl.arange(0, NBV)[None, :])  # [R, NBV]
    codes = _packed_codes(raw, R, D, BITS)
    vs = tl.load(f16 + OFF_VS // 2 + tok).to(tl.float32)
    vz = tl.load(f16 + OFF_VZ // 2 + tok).to(tl.float32)
    pn = (p * vs[:, None]).to(tl.float16)  # p <= 1, v_scale fp16: fits fp16
    return tl.dot(tl.trans(codes), pn), p * vz[:, None]


@triton.jit(do_not_specialize=("num_splits", "part_splits", "split0", "split_tiles", "window"))
def tiles_decode_partial_kernel(
    qs_ptr,
    qa_ptr,
    cache_u8_ptr,
    cache_f16_ptr,
    stride_cb,
    stride_ch,
    block_table_ptr,
    stride_bt,
    seq_lens_ptr,
    qlens_ptr,
    sink_lens_ptr,
    acc_ptr,
    ml_ptr,
    num_q_heads,
    num_splits,
    part_splits,
    split0,
    split_tiles,
    window,
    G: tl.constexpr,
    D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    N: tl.constexpr,
    FRAMES: tl.constexpr,
    SINK: tl.constexpr,
    FIXED: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    OFF_FL: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, split) over its quantized tiles.

    ``qs`` fp16 ``[B, FRAMES, Hq, D]`` / ``qa`` fp32 ``[B, FRAMES, Hq]``: the prepared query rows
    (frame 1, with ``FRAMES = 2``, for tiles flagged ``KEYS_UNROTATED``). Tiles ``[first,
    qlen / G)``, ``first`` = ``sink_lens // G`` with ``SINK``; with ``window > 0`` only positions
    ``> seq_len - 1 - window``. Splits divide those tiles evenly, or with ``FIXED`` split ``s``
    walks tiles ``[s, s + 1) * split_tiles`` (batch-invariant). Writes split ``split0 + s`` of
    ``acc`` ``[B, Hq, part_splits, D]`` and ``ml`` ``[B, Hq, part_splits, 2]`` (an empty split:
    zeros and a running max of -1e30)."""
    seq = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    n_tiles = tl.load(qlens_ptr + seq) // G
    first = n_tiles * 0
    if SINK:
        first = tl.minimum(tl.load(sink_lens_ptr + seq) // G, n_tiles)
    qpos = tl.load(seq_lens_ptr + seq) - 1
    w_lo = tl.maximum(qpos - window + 1, 0)  # first visible position with a window
    if window > 0:
        first = tl.maximum(first, tl.minimum(w_lo // G, n_tiles))
    if FIXED:
        t0 = tl.maximum(split * split_tiles, first)
        t1 = tl.minimum((split + 1) * split_tiles, n_tiles)
    else:
        per = tl.cdiv(n_tiles - first, num_splits)
        t0 = first + split * per
        t1 = tl.minimum(t0 + per, n_tiles)

    n = tl.arange(0, N)
    d = tl.arange(0, D)
    col_ok = n < GROUP
    head = hkv * GROUP + n
    base = seq.to(tl.int64) * (FRAMES * num_q_heads) + head
    q_off = base[None, :] * D + d[:, None]  # [D, N]: the query rows as columns
    q = tl.load(qs_ptr + q_off, mask=col_ok[None, :], other=0.0).to(tl.float32)
    qa = tl.load(qa_ptr + base, mask=col_ok, other=1.0)
    qo = q
    qoa = qa
    if FRAMES == 2:
        qo = tl.load(qs_ptr + q_off + num_q_heads * D, mask=col_ok[None, :], other=0.0)
        qo = qo.to(tl.float32)
        qoa = tl.load(qa_ptr + base + num_q_heads, mask=col_ok, other=1.0)

    m_i = tl.full([N], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([N], dtype=tl.float32)
    acc = tl.zeros([D, N], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = hkv.to(tl.int64) * stride_ch
    j = tl.arange(0, G)
    H: tl.constexpr = G // 2
    mm = tl.arange(0, H)
    # Positions before w_lo are hidden (the sliding window); -1: none.
    w_lo = tl.where(window > 0, w_lo, -1)
    for t in range(t0, t1):
        rec = tl.load(bt_row + t).to(tl.int64) * stride_cb + head_off
        u8 = cache_u8_ptr + rec
        f16 = cache_f16_ptr + rec // 2
        qt = q
        at = qa
        if FRAMES == 2:
            raw = (tl.load(u8 + OFF_FL) & 1) != 0
            qt = tl.where(raw, qo, q)
            at = tl.where(raw, qoa, qa)
        qn, bias = _scales(qt, f16, D, OFF_KS, OFF_KZ)
        if KEY_BITS == 4:
            # The low and high nibbles of a key byte: tokens 2m and 2m + 1 (no reordering).
            raw_k = tl.load(u8 + OFF_KC + mm[:, None] + d[None, :] * H)  # [H, D]
            c0, c1 = unpack_nibbles(raw_k)
            s0 = _finish(tl.dot(c0, qn), bias, at, u8, 2 * mm, t * G + 2 * mm, w_lo, OFF_KT)
            s1 = _finish(tl.dot(c1, qn), bias, at, u8, 2 * mm + 1, t * G + 2 * mm + 1, w_lo, OFF_KT)
            # One reduction over the tokens per quantity (each crosses the warps): the halves
            # are combined elementwise first.
            m_new = tl.maximum(m_i, tl.max(tl.maximum(s0, s1), axis=0))
            p0 = tl.exp2(tl.minimum(s0 - m_new[None, :], 0.0))  # p <= 1
            p1 = tl.exp2(tl.minimum(s1 - m_new[None, :], 0.0))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p0 + p1, axis=0)
            pv, pz0 = _values(p0, 2 * mm, u8, f16, H, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ)
            pv1, pz1 = _values(p1, 2 * mm + 1, u8, f16, H, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ)
            pv += pv1
            pz = tl.sum(pz0 + pz1, axis=0)
        else:
            raw_k = load_packed(u8 + OFF_KC, G * KEY_BITS // 8, True, D, G, KEY_BITS)
            if KEY_BITS == 2:
                codes = _packed_codes(raw_k, D, G, KEY_BITS)  # [D, G] fp16, token order
            else:
                codes = unpack_loaded(raw_k, D, G, KEY_BITS).to(tl.float16)
            sraw = tl.dot(tl.trans(codes), qn)  # [G, N]
            s = _finish(sraw, bias, at, u8, j, t * G + j, w_lo, OFF_KT)
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp2(tl.minimum(s - m_new[None, :], 0.0))  # p <= 1
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p, axis=0)
            pv, pzr = _values(p, j, u8, f16, G, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ)
            pz = tl.sum(pzr, axis=0)
        vc = log8_factor(tl.load(u8 + OFF_VCS + d))
        acc = acc * tl.exp2(m_i - m_new)[None, :] + (pv + pz[None, :]) * vc[:, None]
        m_i = m_new

    part = (seq.to(tl.int64) * num_q_heads + head) * part_splits + split0 + split
    tl.store(acc_ptr + part[None, :] * D + d[:, None], acc, mask=col_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=col_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=col_ok)


def tiles_launch(head_dim: int, key_bits: int) -> dict[str, int]:
    """Launch parameters of :func:`tiles_decode_partial_kernel`: 4 warps (one warpgroup, the
    unit of ``wgmma``; 8 warps take more instructions per tile in all and hold one CTA per SM at
    head_dim 256), one stage (the loads feed the unpacking directly). With 4-bit keys up to
    head_dim 128 the registers are capped at 168, which fit without spills (uncapped: up to 195
    at kvarn_k4v2_g128, head_dim 128), so that 3 CTAs share an SM instead of 2; 2- and 3-bit
    keys would spill under the cap. Chosen from the sm_90 compile on the CPU
    (``tests/sm90_compile.py tiles``), not yet from GPU timings."""
    if key_bits == 4 and head_dim <= 128:
        return {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    return {"num_warps": 4, "num_stages": 1}


def tiles_splitting(head_dim: int, key_bits: int) -> tuple[int, int]:
    """``(programs per SM, least tiles per split)`` the launcher sizes the tiles kernel's
    split-K layout with: two waves of the CTAs an SM holds (3 under :func:`tiles_launch`'s
    register cap, else 2), so that the last wave is not a lone partial one; and at least two
    tiles per split, so that a split's fixed cost (query columns, partial write, combine) stays
    small against its walk."""
    capped = "maxnreg" in tiles_launch(head_dim, key_bits)
    return (6 if capped else 4), 2


def launch_tiles_decode(
    prepared: tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    layout: TileLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    quantized_lens: torch.Tensor,
    sink_lens: torch.Tensor | None,
    sliding_window: int | None,
    acc: torch.Tensor,
    ml: torch.Tensor,
    split0: int,
    num_splits: int,
    split_tiles: int = 0,
) -> None:
    """Write splits ``[split0, split0 + num_splits)`` of the partials ``acc`` / ``ml`` with the
    quantized tiles of each sequence (see :func:`tiles_decode_partial_kernel`). ``prepared``:
    :func:`kvarn_kernels.attention.prep.prepare_queries`'s rows; ``split_tiles > 0``: fixed
    splits of that many tiles (batch-invariant)."""
    qs, qa = prepared
    b, frames, hq, d = qs.shape
    hkv = kv_cache.shape[1]
    p = layout.preset
    tiles_decode_partial_kernel[(b, hkv, num_splits)](
        qs,
        qa,
        kv_cache,
        kv_cache.view(torch.float16),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table,
        block_table.stride(0),
        seq_lens,
        quantized_lens,
        quantized_lens if sink_lens is None else sink_lens,  # unread without a sink
        acc,
        ml,
        hq,
        num_splits,
        acc.shape[2],
        split0,
        split_tiles,
        0 if sliding_window is None else sliding_window,
        G=p.group_size,
        D=d,
        KEY_BITS=p.key_bits,
        VALUE_BITS=p.value_bits,
        GROUP=hq // hkv,
        N=TILES_N,
        FRAMES=frames,
        SINK=sink_lens is not None,
        FIXED=split_tiles > 0,
        **offset_constants(layout),
        **tiles_launch(d, p.key_bits),
    )
