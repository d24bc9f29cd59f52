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
(kvarn_k4v2_g128, head_dim 128, 4 warps, ``tests/sm90_compile.py tiles``): 1,408 SASS
instructions per warp and tile in the loop, 158 registers under the cap of 168, wgmma for every
product (docs/kernels.md has every preset); not yet timed on a GPU.

Query rows come prepared (:func:`kvarn_kernels.attention.prep.prepare_queries`: rotated, scaled by
``scale * log2(e)``, divided by their largest entry, fp16; a second frame for tiles whose keys are
stored in their own channels). With the record's scale folding (see ``kernel.py``)::

    s[t, m] = k_tok[t] * a[m] * (sum_d code[d, t] (q[m, d] k_scale[d]) + sum_d q[m, d] k_zero[d])
    o[d, m] += v_chan[d] * (sum_t vcode[t, d] (p[t, m] v_scale[t]) + sum_t p[t, m] v_zero[t])

4-bit keys of 128-token tiles are scored by nibble halves (the even and odd tokens of a key
byte, as the other kernels do: two products of M = 64); 64-token tiles and other widths are
unpacked into token order (one product of M = G; sm_90 compile of ``kvarn_k4v2_g64`` at
head_dim 128: 863 loop instructions per tile against 1,289 by halves, whose M = 32 runs
``mma.sync``). 1/2/4-bit value codes are unpacked per bit offset and interleaved into channel
order in registers.

Multi-query blocks (verify, chunk continuation) run the same program with ``BLOCK_Q`` query
tokens x the GQA group as columns (up to 32), causal, window and own-K/V masks applied only on
tiles where some key is hidden from some column.
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
    "tiles_query_block",
    "tiles_splitting",
]

TILES_N = 16
"""Query columns of a program (the GQA group, padded): the N side of the dots."""

_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _packed_codes(raw, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """fp16 codes ``[G, D]`` in order from the packed rows ``raw`` ``[G, D*BITS/8]`` of 1/2/4/8-bit
    codes (code ``PER * n + k`` at bit ``BITS * k`` of byte ``n``): value rows, or key channels
    (2-bit keys, 4-bit keys of 64-token tiles)."""
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
def _finish(s, bias, amax, u8, tok, OFF_KT: tl.constexpr):
    """Raw dot products ``s`` ``[R, N]`` of the tile's tokens ``tok`` ``[R]`` -> scores in log2
    units (times each token's log8 scale and each column's ``amax``, plus the zero points)."""
    scale = log8_factor(tl.load(u8 + OFF_KT + tok))
    return (s + bias[None, :]) * (scale[:, None] * amax[None, :])


@triton.jit
def _hide(s, pos, qpos, kv_end, window):
    """``s`` ``[R, N]`` with -inf where position ``pos`` ``[R]`` is hidden from the query at
    ``qpos`` ``[N]``: after it (causal), at or past ``kv_end``, or out of its window."""
    vis = (pos[:, None] <= qpos[None, :]) & (pos[:, None] < kv_end)
    vis = vis & ((window <= 0) | (pos[:, None] > qpos[None, :] - window))
    return tl.where(vis, s, float("-inf"))


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


@triton.jit(
    do_not_specialize=("num_splits", "part_splits", "split0", "split_tiles", "window"),
    do_not_specialize_on_alignment=("qstart_ptr", "block_table_ptr", "seq_lens_ptr", "qlens_ptr",
                                    "sink_lens_ptr"),
)  # fmt: skip
def tiles_decode_partial_kernel(
    qs_ptr,
    qa_ptr,
    qstart_ptr,
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
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    N: tl.constexpr,
    DECODE: tl.constexpr,
    FRESH: tl.constexpr,
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
    """Partial attention of one (sequence, KV head, query block, split) over its quantized tiles.

    Columns ``n`` of the program: query token ``BLOCK_Q * qblk + n // BLOCK_H`` of the sequence
    (decode: its one query) and head ``n % BLOCK_H`` of the KV head's ``GROUP``. ``qs`` fp16
    ``[T, FRAMES, Hq, D]`` / ``qa`` fp32 ``[T, FRAMES, Hq]``: the prepared query rows (frame 1,
    with ``FRAMES = 2``, for tiles flagged ``KEYS_UNROTATED``). A sequence's queries are its last
    ``nq`` positions (``qstart``, multi-query). Tiles ``[first, ceil(min(qlen, kv_end) / G))``,
    ``first`` = ``sink_lens // G`` with ``SINK``, ``kv_end`` = ``seq_len - nq`` with ``FRESH`` (the
    queries' own positions come from the step's K/V, another kernel's), else ``seq_len``; a key
    is hidden from a query after its position, at and past ``kv_end`` and, with ``window > 0``,
    at or before ``qpos - window``. Splits divide the visible tiles evenly, or with ``FIXED``
    split ``s`` walks tiles ``[s, s + 1) * split_tiles`` (batch-invariant). Writes split
    ``split0 + s`` of ``acc`` ``[T, Hq, part_splits, D]`` and ``ml`` ``[T, Hq, part_splits, 2]``
    (an empty split: zeros and a running max of -1e30)."""
    seq = tl.program_id(0)
    hkv = tl.program_id(1)
    if DECODE:
        qblk = 0
        split = tl.program_id(2)
        q_first = seq
        nq = 1
    else:
        qblk = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        q_first = tl.load(qstart_ptr + seq)
        nq = tl.load(qstart_ptr + seq + 1) - q_first
    if qblk * BLOCK_Q < nq:
        seq_len = tl.load(seq_lens_ptr + seq)
        kv_end = seq_len
        if FRESH:
            kv_end = seq_len - nq
        n_tiles = tl.cdiv(tl.minimum(tl.load(qlens_ptr + seq), kv_end), G)
        q_lo = seq_len - nq + qblk * BLOCK_Q  # the block's first and last query positions
        q_hi = seq_len - nq + tl.minimum(nq, qblk * BLOCK_Q + BLOCK_Q) - 1
        n_tiles = tl.minimum(n_tiles, q_hi // G + 1)
        first = n_tiles * 0
        if SINK:
            first = tl.minimum(tl.load(sink_lens_ptr + seq) // G, n_tiles)
        if window > 0:
            first = tl.maximum(first, tl.minimum(tl.maximum(q_lo - window + 1, 0) // G, n_tiles))
        if FIXED:
            t0 = tl.maximum(split * split_tiles, first)
            t1 = tl.minimum((split + 1) * split_tiles, n_tiles)
        else:
            per = tl.cdiv(n_tiles - first, num_splits)
            t0 = first + split * per
            t1 = tl.minimum(t0 + per, n_tiles)

        n = tl.arange(0, N)
        d = tl.arange(0, D)
        qi = qblk * BLOCK_Q + n // BLOCK_H
        hh = n % BLOCK_H
        col_ok = (n // BLOCK_H < BLOCK_Q) & (qi < nq) & (hh < GROUP)
        tok = (q_first + qi).to(tl.int64)
        head = hkv * GROUP + hh
        qpos = seq_len - nq + qi
        base = tok * (FRAMES * num_q_heads) + head
        q_off = base[None, :] * D + d[:, None]  # [D, N]: the query rows as columns
        q = tl.load(qs_ptr + q_off, mask=col_ok[None, :], other=0.0)  # fp16
        qa = tl.load(qa_ptr + base, mask=col_ok, other=1.0)
        qo = q
        qoa = qa
        if FRAMES == 2:
            qo = tl.load(qs_ptr + q_off + num_q_heads * D, mask=col_ok[None, :], other=0.0)
            qoa = tl.load(qa_ptr + base + num_q_heads, mask=col_ok, other=1.0)

        m_i = tl.full([N], _NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([N], dtype=tl.float32)
        acc = tl.zeros([D, N], dtype=tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        head_off = hkv.to(tl.int64) * stride_ch
        j = tl.arange(0, G)
        H: tl.constexpr = G // 2
        mm = tl.arange(0, H)
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
            qn, bias = _scales(qt.to(tl.float32), f16, D, OFF_KS, OFF_KZ)
            # Per-element masks only where some key of the tile is hidden from some column
            # (decode tiles never are, unless a window cuts them).
            masked = (t * G + G - 1 > q_lo) | (t * G + G > kv_end)
            masked = masked | ((window > 0) & (t * G <= q_hi - window))
            if (KEY_BITS == 4) and (G >= 128):
                # The low and high nibbles of a key byte: tokens 2m and 2m + 1 (no reordering;
                # halves of 64 tokens, wgmma's M; shorter tiles take token order below).
                raw_k = tl.load(u8 + OFF_KC + mm[:, None] + d[None, :] * H)  # [H, D]
                c0, c1 = unpack_nibbles(raw_k)
                s0 = _finish(tl.dot(c0, qn), bias, at, u8, 2 * mm, OFF_KT)
                s1 = _finish(tl.dot(c1, qn), bias, at, u8, 2 * mm + 1, OFF_KT)
                if masked:
                    s0 = _hide(s0, t * G + 2 * mm, qpos, kv_end, window)
                    s1 = _hide(s1, t * G + 2 * mm + 1, qpos, kv_end, window)
                # One reduction over the tokens per quantity (each crosses the warps): the
                # halves are combined elementwise first.
                m_new = tl.maximum(m_i, tl.max(tl.maximum(s0, s1), axis=0))
                p0 = tl.exp2(tl.minimum(s0 - m_new[None, :], 0.0))  # p <= 1
                p1 = tl.exp2(tl.minimum(s1 - m_new[None, :], 0.0))
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p0 + p1, axis=0)
                pv, pz0 = _values(p0, 2 * mm, u8, f16, H, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ)
                pv1, pz1 = _values(
                    p1, 2 * mm + 1, u8, f16, H, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ
                )
                pv += pv1
                pz = tl.sum(pz0 + pz1, axis=0)
            else:
                raw_k = load_packed(u8 + OFF_KC, G * KEY_BITS // 8, True, D, G, KEY_BITS)
                if (KEY_BITS == 2) or (KEY_BITS == 4):
                    codes = _packed_codes(raw_k, D, G, KEY_BITS)  # [D, G] fp16, token order
                else:
                    codes = unpack_loaded(raw_k, D, G, KEY_BITS).to(tl.float16)
                s = _finish(tl.dot(tl.trans(codes), qn), bias, at, u8, j, OFF_KT)  # [G, N]
                if masked:
                    s = _hide(s, t * G + j, qpos, kv_end, window)
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                p = tl.exp2(tl.minimum(s - m_new[None, :], 0.0))  # p <= 1
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p, axis=0)
                pv, pzr = _values(p, j, u8, f16, G, D, VALUE_BITS, OFF_VC, OFF_VS, OFF_VZ)
                pz = tl.sum(pzr, axis=0)
            vc = log8_factor(tl.load(u8 + OFF_VCS + d))
            acc = acc * tl.exp2(m_i - m_new)[None, :] + (pv + pz[None, :]) * vc[:, None]
            m_i = m_new

        part = (tok * num_q_heads + head) * part_splits + split0 + split
        tl.store(acc_ptr + part[None, :] * D + d[:, None], acc, mask=col_ok[None, :])
        tl.store(ml_ptr + part * 2, m_i, mask=col_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=col_ok)


def tiles_launch(head_dim: int, key_bits: int, columns: int = TILES_N) -> dict[str, int]:
    """Launch parameters of :func:`tiles_decode_partial_kernel`: 4 warps (one warpgroup, the
    unit of ``wgmma``; 8 warps take more instructions per tile in all and hold one CTA per SM at
    head_dim 256), one stage (the loads feed the unpacking directly). With 4-bit keys up to
    head_dim 128 the registers are capped at 168, which fit without spills (uncapped: up to 195
    at kvarn_k4v2_g128, head_dim 128), so that 3 CTAs share an SM instead of 2; 2- and 3-bit
    keys would spill under the cap, and so would multi-query programs of more than 16
    ``columns``. Chosen from the sm_90 compile on the CPU (``tests/sm90_compile.py tiles``), not
    yet from GPU timings."""
    if key_bits == 4 and head_dim <= 128 and columns <= TILES_N:
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


def tiles_query_block(block_h: int, max_query_len: int) -> int:
    """Query tokens per program of the tiles kernel in multi-query calls: ``N`` = tokens x
    ``block_h`` padded heads at most 32 columns (the ``[D, N]`` accumulator and the query
    columns stay in registers), at least one token."""
    return max(1, min(1 << max(0, (max_query_len - 1).bit_length()), 32 // block_h))


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
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
    fresh: bool = False,
) -> None:
    """Write splits ``[split0, split0 + num_splits)`` of the partials ``acc`` / ``ml`` with the
    quantized tiles of each sequence (see :func:`tiles_decode_partial_kernel`). ``prepared``:
    :func:`kvarn_kernels.attention.prep.prepare_queries`'s rows; ``split_tiles > 0``: fixed
    splits of that many tiles (batch-invariant). ``query_start_loc``: a multi-query call (int32
    ``[B + 1]``, queries of at most ``max_query_len`` tokens, :func:`tiles_query_block` per
    program); ``fresh``: its queries' own positions are read elsewhere (``fresh_kv``)."""
    qs, qa = prepared
    _, frames, hq, d = qs.shape
    b = seq_lens.shape[0]
    hkv = kv_cache.shape[1]
    group = hq // hkv
    block_h = 1 << max(0, (group - 1).bit_length())
    decode = query_start_loc is None
    block_q = 1 if decode else tiles_query_block(block_h, max_query_len)
    qblocks = 1 if decode else -(-max(max_query_len, 1) // block_q)
    p = layout.preset
    columns = max(TILES_N, block_q * block_h)
    tiles_decode_partial_kernel[(b, hkv, qblocks * num_splits)](
        qs,
        qa,
        seq_lens if decode else query_start_loc,  # unread when decoding
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
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        N=columns,
        DECODE=decode,
        FRESH=fresh,
        FRAMES=frames,
        SINK=sink_lens is not None,
        FIXED=split_tiles > 0,
        **offset_constants(layout),
        **tiles_launch(d, p.key_bits, columns),
    )
