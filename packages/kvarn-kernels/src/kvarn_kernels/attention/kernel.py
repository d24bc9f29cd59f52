"""Triton kernels of attention over the quantized paged cache (decode and multi-query).

Stage 1 (``attention_partial_kernel``): one program = (sequence, KV head, query block, split).
Its rows are ``BLOCK_Q`` query tokens x the ``GROUP`` query heads of the KV head, so every tile is
read once per KV head.  It rotates the queries in registers, walks its share of the sequence's
chunks of ``G`` positions (quantized tiles through the block table, then the staged open tokens),
dequantizes in registers and keeps an fp32 online softmax (base 2).  Stage 2
(``attention_combine_kernel``) merges the splits and un-rotates the output.

Score of a quantized tile, with the scale folding of the record format:
``s[m, t] = k_token_scale[t] * (sum_d (q[m, d] k_scale[d]) code[d, t] + sum_d q[m, d] k_zero[d])``:
one tensor-core dot of the row-normalized ``q * k_scale`` (fp16) with the integer codes (exact in
fp16), fp32 accumulation.  Likewise for values:
``o[m, d] += v_channel_scale[d] * (sum_t (p[m, t] v_scale[t]) vcode[t, d] + sum_t p[m, t] v_zero[t])``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn_kernels._triton import INTERPRET, dot_lowp, fwht_rows, round_to, unpack_rows

__all__ = ["attention_combine_kernel", "attention_partial_kernel"]

# A finite "minus infinity" for the running max, so exp2 of differences stays 0 or 1.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _online_update(s, m_i, l_i, acc):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _visible(pos, qpos, window):
    # Causal, and inside the sliding window when window > 0: pos in (qpos - window, qpos].
    vis = pos[None, :] <= qpos[:, None]
    return vis & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [
        triton.Config({}, num_warps=w, num_stages=s)
        for w, s in ((4, 1), (4, 2), (4, 3), (8, 2))
    ]


@triton.autotune(
    configs=_configs(),
    key=["G", "D", "KEY_BITS", "VALUE_BITS", "BLOCK_M", "FP32", "DECODE"],
)
@triton.jit
def attention_partial_kernel(
    q_ptr, stride_qt, stride_qh,
    qstart_ptr,
    cache_u8_ptr, cache_f16_ptr, stride_cb, stride_ch,
    stage_ptr, stride_ss, stride_skv, stride_sp, stride_sh,
    block_table_ptr, stride_bt,
    seq_lens_ptr, qlens_ptr, slots_ptr,
    acc_ptr, ml_ptr, num_q_heads,
    qk_scale, window, rsqrt_d,
    G: tl.constexpr, D: tl.constexpr, SG: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr, DECODE: tl.constexpr, FP32: tl.constexpr,
    OFF_KC: tl.constexpr, OFF_KS: tl.constexpr, OFF_KZ: tl.constexpr, OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr, OFF_VCS: tl.constexpr, OFF_VS: tl.constexpr, OFF_VZ: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, query block, split).

    Writes ``acc`` ``[num_q_tokens, Hq, SPLITS, D]`` (unnormalized, rotated frame) and
    ``ml`` ``[num_q_tokens, Hq, SPLITS, 2]`` (running max in log2 units, softmax denominator).
    """
    seq = tl.program_id(0)
    hkv = tl.program_id(1)
    qblk = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    if DECODE:
        q_first = seq
        nq = 1
    else:
        q_first = tl.load(qstart_ptr + seq)
        nq = tl.load(qstart_ptr + seq + 1) - q_first
    if qblk * BLOCK_Q < nq:
        seq_len = tl.load(seq_lens_ptr + seq)
        qlen = tl.load(qlens_ptr + seq)
        slot = tl.load(slots_ptr + seq).to(tl.int64)

        rows = tl.arange(0, BLOCK_M)
        rq = rows // BLOCK_H
        rh = rows % BLOCK_H
        qi = qblk * BLOCK_Q + rq
        row_ok = (rq < BLOCK_Q) & (qi < nq) & (rh < GROUP)
        tok = (q_first + qi).to(tl.int64)
        head = hkv * GROUP + rh
        qpos = seq_len - nq + qi
        d = tl.arange(0, D)
        g = tl.arange(0, G)
        q_off = tok[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        # Into the rotated frame, with the softmax scale and log2(e) folded in.
        q = fwht_rows(q, BLOCK_M, D) * (rsqrt_d * qk_scale)

        # Chunk c covers positions [c*G, (c+1)*G): a quantized tile for c < qlen / G (qlen is a
        # multiple of G), staged tokens after.  Only chunks some row of the block can see.
        n_tiles = qlen // G
        last_q = tl.minimum(nq, qblk * BLOCK_Q + BLOCK_Q) - 1
        hi = (seq_len - nq + last_q) // G + 1
        lo = tl.maximum(seq_len - nq + qblk * BLOCK_Q - window + 1, 0) // G
        lo = tl.where(window > 0, lo, 0)
        per = tl.cdiv(hi - lo, SPLITS)
        c0 = lo + split * per
        c1 = tl.minimum(c0 + per, hi)

        m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        for c in range(c0, tl.minimum(c1, n_tiles)):
            block = tl.load(bt_row + c).to(tl.int64)
            rec = block * stride_cb + hkv.to(tl.int64) * stride_ch
            u8 = cache_u8_ptr + rec
            f16 = cache_f16_ptr + rec // 2
            k_codes = unpack_rows(u8 + OFF_KC, G * KEY_BITS // 8, D, G, KEY_BITS)  # [D, G]
            k_scale = tl.load(f16 + OFF_KS // 2 + d).to(tl.float32)
            k_zero = tl.load(f16 + OFF_KZ // 2 + d).to(tl.float32)
            k_tok = tl.load(f16 + OFF_KT // 2 + g).to(tl.float32)
            qk = q * k_scale[None, :]
            q_amax = tl.max(tl.abs(qk), axis=1)
            q_amax = tl.where(q_amax > 0, q_amax, 1.0)
            qn = qk / q_amax[:, None]
            if FP32:
                raw = tl.dot(qn, k_codes.to(tl.float32), input_precision="ieee")
            else:
                raw = tl.dot(qn.to(tl.float16), k_codes.to(tl.float16))
            bias = tl.sum(q * k_zero[None, :], axis=1)
            s = (raw * q_amax[:, None] + bias[:, None]) * k_tok[None, :]
            s = tl.where(_visible(c * G + g, qpos, window), s, float("-inf"))
            p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)

            v_codes = unpack_rows(u8 + OFF_VC, D * VALUE_BITS // 8, G, D, VALUE_BITS)  # [G, D]
            v_scale = tl.load(f16 + OFF_VS // 2 + g).to(tl.float32)
            v_zero = tl.load(f16 + OFF_VZ // 2 + g).to(tl.float32)
            v_chan = tl.load(f16 + OFF_VCS // 2 + d).to(tl.float32)
            v_amax = tl.max(tl.abs(v_scale), axis=0)
            v_amax = tl.where(v_amax > 0, v_amax, 1.0)
            pn = p * (v_scale / v_amax)[None, :]
            if FP32:
                pv = tl.dot(pn, v_codes.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(pn.to(tl.float16), v_codes.to(tl.float16))
            pz = tl.sum(p * v_zero[None, :], axis=1)
            acc += (pv * v_amax + pz[:, None]) * v_chan[None, :]

        stage = stage_ptr + slot * stride_ss + hkv.to(tl.int64) * stride_sh
        for c in range(tl.maximum(c0, n_tiles), c1):
            pos = c * G + g
            valid = pos < seq_len
            spos = (pos % SG).to(tl.int64)
            s_off = spos[:, None] * stride_sp + d[None, :]
            k = tl.load(stage + s_off, mask=valid[:, None], other=0.0)  # [G, D] rotated
            if FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = dot_lowp(q.to(k.dtype), tl.trans(k))
            vis = _visible(pos, qpos, window) & valid[None, :]
            s = tl.where(vis, s, float("-inf"))
            p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
            v = tl.load(stage + stride_skv + s_off, mask=valid[:, None], other=0.0)
            if FP32:
                acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc += dot_lowp(p.to(v.dtype), v)

        part = (tok * num_q_heads + head.to(tl.int64)) * SPLITS + split
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def attention_combine_kernel(
    acc_ptr, ml_ptr, num_q_heads,
    out_ptr, stride_ot, stride_oh,
    qend_ptr, rsqrt_d,
    D: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DECODE: tl.constexpr,
):
    """Merge the splits of one (query token, KV head), un-rotate, write ``out`` rows."""
    tok = tl.program_id(0).to(tl.int64)
    hkv = tl.program_id(1)
    live = True
    if not DECODE:
        live = tok < tl.load(qend_ptr)  # rows past query_start_loc[-1] are padding
    if live:
        h = tl.arange(0, BLOCK_H)
        head = (hkv * GROUP + h).to(tl.int64)
        hmask = h < GROUP
        sp = tl.arange(0, BLOCK_S)
        mask = hmask[:, None] & (sp < SPLITS)[None, :]
        part = (tok * num_q_heads + head)[:, None] * SPLITS + sp[None, :]  # [BLOCK_H, BLOCK_S]
        m = tl.load(ml_ptr + part * 2, mask=mask, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=mask, other=0.0)
        m_max = tl.max(m, axis=1)
        m_max = tl.where(hmask, m_max, 0.0)
        w = tl.exp2(m - m_max[:, None])
        denom = tl.sum(w * l, axis=1)
        denom = tl.where(hmask, denom, 1.0)
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + part[:, :, None] * D + d[None, None, :], mask=mask[:, :, None], other=0.0)
        o = tl.sum(w[:, :, None] * acc, axis=1) / denom[:, None]
        o = fwht_rows(o, BLOCK_H, D) * rsqrt_d
        dst = out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, round_to(o, out_ptr.dtype.element_ty), mask=hmask[:, None])
