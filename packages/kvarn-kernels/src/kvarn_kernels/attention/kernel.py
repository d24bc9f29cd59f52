"""Triton kernels of attention over the quantized paged cache (decode and multi-query).

Stage 1 (``attention_partial_kernel``): one program = (sequence, KV head, query block, split).
Its rows are ``BLOCK_Q`` query tokens x the ``GROUP`` query heads of the KV head, so every tile is
read once per KV head.  It rotates the queries in registers, walks its share of the sequence's
steps of ``SUB`` positions (the exact first tile from the staging's sink rows when the sequence
keeps one, quantized tiles through the block table, then the staged open tokens; with ``FRESH``,
the queries' own positions from the step's K/V instead), dequantizes in registers and keeps an
fp32 online softmax (base 2).  Stage 2
(``attention_combine_kernel``) merges the splits and un-rotates the output.

Score of a quantized tile, with the scale folding of the record format:
``s[m, t] = k_token_scale[t] * (sum_d (q[m, d] k_scale[d]) code[d, t] + sum_d q[m, d] k_zero[d])``:
one tensor-core dot of ``q * k_scale`` (fp16) with the integer codes (exact in fp16), fp32
accumulation.  The query rows are divided once by their largest entry, so ``|q| <= 1`` and
``q * k_scale`` (``k_scale`` is fp16) cannot overflow fp16; no per-tile reduction is needed.
Likewise for values, with ``p <= 1``:
``o[m, d] += v_channel_scale[d] *
(sum_t (p[m, t] v_scale[t]) vcode[t, d] + sum_t p[m, t] v_zero[t])``.
The two balancing factors are one-byte log codes (``2^(n/16 - 1)``, kvarn_math.log8), decoded
with one ``exp2`` each as they are loaded.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import (
    INTERPRET,
    fwht_rows,
    load_packed,
    log8_factor,
    round_to,
    staging_rows,
    unit_rows,
    unpack_crumbs,
    unpack_loaded,
    unpack_nibbles,
)

__all__ = [
    "attention_combine_kernel",
    "attention_partial_kernel",
    "attention_partial_kernel_autotuned",
    "default_launch",
]

# A finite "minus infinity" for the running max, so exp2 of differences stays 0 or 1.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
_INTERP: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _online_update(s, m_i, l_i, acc):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    # <= 0 up to rounding (the max and the difference may round the scores differently);
    # the clamp keeps p <= 1, so p * v_scale fits fp16 even when v_scale is 65504.
    p = tl.exp2(tl.minimum(s - m_new[:, None], 0.0))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _visible(pos, qpos, window, kv_end, CLIP: tl.constexpr):
    # Causal, and inside the sliding window when window > 0: pos in (qpos - window, qpos];
    # with CLIP also before kv_end.
    vis = pos[None, :] <= qpos[:, None]
    if CLIP:
        vis = vis & (pos[None, :] < kv_end)
    return vis & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))


@triton.jit
def _exact_step(q, qpos, window, pos, valid, m_i, l_i, acc, k_ptrs, v_ptrs, FP32):
    """Online-softmax update with one step of unquantized (rotated) keys and values at
    ``k_ptrs`` / ``v_ptrs`` (``[SUB, D]``), positions ``pos``, rows with ``valid`` loaded."""
    k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)  # [SUB, D] rotated
    if FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif k.dtype == tl.bfloat16:
        s = _bf16_dot(q, tl.trans(k))  # bf16 keys past fp16's range as they are
    else:
        s = tl.dot(q.to(tl.float16), tl.trans(k))
    vis = _visible(pos, qpos, window, 0, False) & valid[None, :]  # valid bounds the positions
    s = tl.where(vis, s, float("-inf"))
    p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
    return m_i, l_i, _exact_values(p, acc, v_ptrs, valid, FP32)


@triton.jit
def _exact_values(p, acc, v_ptrs, valid, FP32):
    """``acc + p V`` with the unquantized (rotated) values at ``v_ptrs`` ``[SUB, D]``."""
    v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    if FP32:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    elif v.dtype == tl.bfloat16:
        acc += _bf16_dot(p, v)
    else:
        acc += tl.dot(p.to(tl.float16), v)  # p <= 1: 11 significant bits
    return acc


@triton.jit
def _bf16_dot(x, y):
    """``x @ y`` (fp32) of fp32 ``x`` and bf16 ``y``, the exact rows of a bf16 model: ``y`` as
    it is (a bf16 model's massive activations pass fp16's 65504, where an fp16 operand would
    saturate them) and ``x`` as two bf16 parts, ``hi + lo``, which keep 16 significant bits
    (more than fp16's 11: queries and probabilities) over fp32's range (probabilities under
    fp16's 6e-8 still weigh values of 1e20). Every product is exact in the fp32 accumulator."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    if _INTERP:
        # The interpreter's bf16 x bf16 dot reads the operands' bits wrongly: the same
        # products (exact in fp32) through an fp32 dot.
        yf = y.to(tl.float32)
        out = tl.dot(hi.to(tl.float32), yf, input_precision="ieee")
        return tl.dot(lo.to(tl.float32), yf, out, input_precision="ieee")
    else:
        return tl.dot(lo, y, tl.dot(hi, y))


@triton.jit
def _stage_rows(stage, pos, stride_sp, RING: tl.constexpr, SINK: tl.constexpr, D: tl.constexpr):
    """Pointers ``[SUB, D]`` to positions ``pos`` of a staging ring (kvarn_kernels.staging_view)."""
    d = tl.arange(0, D)
    return stage + staging_rows(pos, RING, SINK).to(tl.int64)[:, None] * stride_sp + d[None, :]


@triton.jit
def _dense_step(
    q,
    qpos,
    window,
    c,
    m_i,
    l_i,
    acc,
    k_stage,
    v_stage,
    stride_sp,
    kv_end,
    D: tl.constexpr,
    SUB: tl.constexpr,
    KSG: tl.constexpr,
    KSINK: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    FP32: tl.constexpr,
):
    """One step of unquantized (rotated) tokens from staging, positions before ``kv_end``: keys
    at ``k_stage`` rows ``staging_rows(p, KSG, KSINK)``, values at ``v_stage`` rows
    ``staging_rows(p, SG, SINK_ROWS)``."""
    pos = c * SUB + tl.arange(0, SUB)
    return _exact_step(
        q,
        qpos,
        window,
        pos,
        pos < kv_end,
        m_i,
        l_i,
        acc,
        _stage_rows(k_stage, pos, stride_sp, KSG, KSINK, D),
        _stage_rows(v_stage, pos, stride_sp, SG, SINK_ROWS, D),
        FP32,
    )


@triton.jit
def _fresh_step(
    q,
    qpos,
    window,
    c,
    m_i,
    l_i,
    acc,
    fk,
    fv,
    stride_fkt,
    stride_fvt,
    row0,
    fresh_start,
    seq_len,
    D: tl.constexpr,
    SUB: tl.constexpr,
    FP32: tl.constexpr,
):
    """One step of the queries' own K/V from this step (rotated frame), positions
    ``[fresh_start, seq_len)``: position ``p`` is row ``row0 + p`` of ``fk`` / ``fv``."""
    pos = c * SUB + tl.arange(0, SUB)
    d = tl.arange(0, D)
    valid = (pos >= fresh_start) & (pos < seq_len)
    row = (row0 + pos).to(tl.int64)[:, None]
    return _exact_step(
        q,
        qpos,
        window,
        pos,
        valid,
        m_i,
        l_i,
        acc,
        fk + row * stride_fkt + d[None, :],
        fv + row * stride_fvt + d[None, :],
        FP32,
    )


@triton.jit
def _load_step(
    cache_u8_ptr,
    cache_f16_ptr,
    block,
    head_off,
    part,
    ok,
    G: tl.constexpr,
    D: tl.constexpr,
    SUB: tl.constexpr,
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
    RAW_KEYS: tl.constexpr,
):
    """Issue every load of one step (part ``part`` of the tile in ``block``); ``ok`` masks all.
    ``raw``: the tile's keys are in their own channels (``RAW_KEYS``: its flag is read)."""
    k_raw, k_scale, k_zero, k_tok, raw = _load_keys(
        cache_u8_ptr, cache_f16_ptr, block, head_off, part, ok, G, D, SUB, KEY_BITS,
        OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_FL, RAW_KEYS,
    )  # fmt: skip
    rec = block.to(tl.int64) * head_off[0] + head_off[1]
    u8 = cache_u8_ptr + rec
    f16 = cache_f16_ptr + rec // 2
    d = tl.arange(0, D)
    j = part * SUB + tl.arange(0, SUB)
    # V codes [SUB, D]: rows part*SUB.. of the [G, D] per-token packed rows.
    v_raw = load_packed(
        u8 + OFF_VC + part * (SUB * (D * VALUE_BITS // 8)),
        D * VALUE_BITS // 8,
        ok,
        SUB,
        D,
        VALUE_BITS,
    )
    v_scale = tl.load(f16 + OFF_VS // 2 + j, mask=ok, other=0.0)
    v_zero = tl.load(f16 + OFF_VZ // 2 + j, mask=ok, other=0.0)
    v_chan = tl.load(u8 + OFF_VCS + d, mask=ok, other=0)
    return k_raw, k_scale, k_zero, k_tok, v_raw, v_scale, v_zero, v_chan, raw


@triton.jit
def _load_keys(
    cache_u8_ptr,
    cache_f16_ptr,
    block,
    head_off,
    part,
    ok,
    G: tl.constexpr,
    D: tl.constexpr,
    SUB: tl.constexpr,
    KEY_BITS: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_FL: tl.constexpr,
    RAW_KEYS: tl.constexpr,
):
    """The key loads of one step (:func:`_load_step` without the values)."""
    rec = block.to(tl.int64) * head_off[0] + head_off[1]
    u8 = cache_u8_ptr + rec
    f16 = cache_f16_ptr + rec // 2
    d = tl.arange(0, D)
    j = part * SUB + tl.arange(0, SUB)
    # K codes [D, SUB]: columns part*SUB.. of the [D, G] per-channel packed rows.
    k_raw = load_packed(
        u8 + OFF_KC + part * (SUB * KEY_BITS // 8), G * KEY_BITS // 8, ok, D, SUB, KEY_BITS
    )
    k_scale = tl.load(f16 + OFF_KS // 2 + d, mask=ok, other=0.0)
    k_zero = tl.load(f16 + OFF_KZ // 2 + d, mask=ok, other=0.0)
    k_tok = tl.load(u8 + OFF_KT + j, mask=ok, other=0)  # log8 codes
    raw = ok & False
    if RAW_KEYS:
        raw = (tl.load(u8 + OFF_FL, mask=ok, other=0) & 1) != 0
    return k_raw, k_scale, k_zero, k_tok, raw


@triton.jit
def _record_scores(
    q,
    q_amax,
    qpos,
    window,
    kv_end,
    c,
    k_raw,
    k_scale,
    k_zero,
    k_tok,
    D: tl.constexpr,
    SUB: tl.constexpr,
    KEY_BITS: tl.constexpr,
    FP32: tl.constexpr,
    CLIP: tl.constexpr,
):
    """Scores (log2 units, invisible keys -inf) of one step's keys from their record."""
    j = tl.arange(0, SUB)
    k_codes = unpack_loaded(k_raw, D, SUB, KEY_BITS)  # [D, SUB]
    qn = q * k_scale.to(tl.float32)[None, :]  # |q| <= 1: fits fp16 (k_scale is fp16)
    if FP32:
        raw = tl.dot(qn, k_codes.to(tl.float32), input_precision="ieee")
    else:
        raw = tl.dot(qn.to(tl.float16), k_codes.to(tl.float16))
    bias = tl.sum(q * k_zero.to(tl.float32)[None, :], axis=1)
    s = (raw + bias[:, None]) * (q_amax[:, None] * log8_factor(k_tok)[None, :])
    return tl.where(_visible(c * SUB + j, qpos, window, kv_end, CLIP), s, float("-inf"))


@triton.jit
def _window_step(
    qs,
    q_amax,
    qos,
    qo_amax,
    qpos,
    window,
    kv_end,
    c,
    m_i,
    l_i,
    acc,
    cache_u8_ptr,
    cache_f16_ptr,
    bt_row,
    head_off,
    v_stage,
    stride_sp,
    G: tl.constexpr,
    D: tl.constexpr,
    SUB: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    KEY_BITS: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_FL: tl.constexpr,
    RAW_KEYS: tl.constexpr,
    FP32: tl.constexpr,
    CLIP: tl.constexpr,
):
    """One step of a values-only exact window: keys from the tile's record, values exact from
    ``v_stage`` rows ``staging_rows(p, SG, SINK_ROWS)`` (kvarn_math.quantize_sequence with
    ``window_keys=False``); 4-bit keys by nibble halves (:func:`_window_step_phased`)."""
    if KEY_BITS == 4:
        m_i, l_i, acc = _window_step_phased(
            qs, q_amax, qos, qo_amax, qpos, window, kv_end, c, m_i, l_i, acc, cache_u8_ptr,
            cache_f16_ptr, bt_row, head_off, v_stage, stride_sp, G, D, SUB, SG, SINK_ROWS,
            OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_FL, RAW_KEYS, FP32, CLIP,
        )  # fmt: skip
    else:
        PARTS: tl.constexpr = G // SUB
        block = tl.load(bt_row + c // PARTS)
        k_raw, k_scale, k_zero, k_tok, raw = _load_keys(
            cache_u8_ptr, cache_f16_ptr, block, head_off, c % PARTS, c >= 0, G, D, SUB,
            KEY_BITS, OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_FL, RAW_KEYS,
        )  # fmt: skip
        qsel, asel = _query_for(raw, qs, q_amax, qos, qo_amax, RAW_KEYS)
        s = _record_scores(
            qsel, asel, qpos, window, kv_end, c, k_raw, k_scale, k_zero, k_tok, D, SUB,
            KEY_BITS, FP32, CLIP,
        )  # fmt: skip
        p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
        pos = c * SUB + tl.arange(0, SUB)
        v_ptrs = _stage_rows(v_stage, pos, stride_sp, SG, SINK_ROWS, D)
        acc = _exact_values(p, acc, v_ptrs, pos >= 0, FP32)
    return m_i, l_i, acc


@triton.jit
def _phased_scores(q, q_amax, k_raw, k_scale, k_zero, k_tok0, k_tok1, FP32: tl.constexpr):
    """Scores (log2 units) of the even and odd tokens of a step of 4-bit keys, from the low and
    high nibbles of the key bytes ``k_raw`` ``[D, SUB // 2]`` without reordering them: the
    scaled query rows ``q`` dotted with the codes, plus the zero points, times each row's
    ``q_amax`` and each token's log8 scale (``k_tok0``, ``k_tok1``)."""
    qn = q * k_scale.to(tl.float32)[None, :]  # |q| <= 1: fits fp16 (k_scale is fp16)
    bias = tl.sum(q * k_zero.to(tl.float32)[None, :], axis=1)
    kc0, kc1 = unpack_nibbles(k_raw)  # [D, NBK] fp16 codes: tokens 2m, 2m + 1
    if FP32:
        s0 = tl.dot(qn, kc0.to(tl.float32), input_precision="ieee")
        s1 = tl.dot(qn, kc1.to(tl.float32), input_precision="ieee")
    else:
        s0 = tl.dot(qn.to(tl.float16), kc0)
        s1 = tl.dot(qn.to(tl.float16), kc1)
    s0 = (s0 + bias[:, None]) * (q_amax[:, None] * log8_factor(k_tok0)[None, :])
    s1 = (s1 + bias[:, None]) * (q_amax[:, None] * log8_factor(k_tok1)[None, :])
    return s0, s1


@triton.jit
def _phased_softmax(s0, s1, m_i, l_i):
    """The online-softmax update over both halves of a phased step: ``(m_new, alpha, p0, p1,
    l_new)``; the caller rescales its accumulators by ``alpha`` and adds ``p0``, ``p1``'s
    values."""
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s0, axis=1), tl.max(s1, axis=1)))
    alpha = tl.exp2(m_i - m_new)
    p0 = tl.exp2(tl.minimum(s0 - m_new[:, None], 0.0))  # p <= 1, as _online_update
    p1 = tl.exp2(tl.minimum(s1 - m_new[:, None], 0.0))
    l_i = l_i * alpha + tl.sum(p0, axis=1) + tl.sum(p1, axis=1)
    return m_new, alpha, p0, p1, l_i


@triton.jit
def _window_step_phased(
    qs,
    q_amax,
    qos,
    qo_amax,
    qpos,
    window,
    kv_end,
    c,
    m_i,
    l_i,
    acc,
    cache_u8_ptr,
    cache_f16_ptr,
    bt_row,
    head_off,
    v_stage,
    stride_sp,
    G: tl.constexpr,
    D: tl.constexpr,
    SUB: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_FL: tl.constexpr,
    RAW_KEYS: tl.constexpr,
    FP32: tl.constexpr,
    CLIP: tl.constexpr,
):
    """:func:`_window_step` for 4-bit keys without unpacking the codes into token order (a
    register reshuffle): as in :func:`_attend_step_phased`, the low and high nibbles of the key
    bytes score the even and odd tokens, and each half multiplies its own exact value rows."""
    PARTS: tl.constexpr = G // SUB
    NBK: tl.constexpr = SUB // 2
    block = tl.load(bt_row + c // PARTS)
    part = c % PARTS
    rec = block.to(tl.int64) * head_off[0] + head_off[1]
    u8 = cache_u8_ptr + rec
    f16 = cache_f16_ptr + rec // 2
    d = tl.arange(0, D)
    mm = tl.arange(0, NBK)
    k_raw = tl.load(u8 + OFF_KC + part * NBK + d[:, None] * (G // 2) + mm[None, :])  # [D, NBK]
    k_scale = tl.load(f16 + OFF_KS // 2 + d)
    k_zero = tl.load(f16 + OFF_KZ // 2 + d)
    even = part * SUB + 2 * mm  # the tile's tokens 2m (low nibbles) and 2m + 1 (high nibbles)
    k_tok0 = tl.load(u8 + OFF_KT + even)  # log8 codes
    k_tok1 = tl.load(u8 + OFF_KT + even + 1)
    pos0 = c * SUB + 2 * mm
    raw = block < 0  # False
    if RAW_KEYS:
        raw = (tl.load(u8 + OFF_FL) & 1) != 0
    q, a = _query_for(raw, qs, q_amax, qos, qo_amax, RAW_KEYS)
    s0, s1 = _phased_scores(q, a, k_raw, k_scale, k_zero, k_tok0, k_tok1, FP32)
    s0 = tl.where(_visible(pos0, qpos, window, kv_end, CLIP), s0, float("-inf"))
    s1 = tl.where(_visible(pos0 + 1, qpos, window, kv_end, CLIP), s1, float("-inf"))
    m_new, alpha, p0, p1, l_i = _phased_softmax(s0, s1, m_i, l_i)
    acc = acc * alpha[:, None]
    ok = mm >= 0
    acc = _exact_values(p0, acc, _stage_rows(v_stage, pos0, stride_sp, SG, SINK_ROWS, D), ok, FP32)
    acc = _exact_values(
        p1, acc, _stage_rows(v_stage, pos0 + 1, stride_sp, SG, SINK_ROWS, D), ok, FP32
    )
    return m_new, l_i, acc


@triton.jit
def _attend_step(
    q,
    q_amax,
    qpos,
    window,
    kv_end,
    c,
    m_i,
    l_i,
    acc,
    k_raw,
    k_scale,
    k_zero,
    k_tok,
    v_raw,
    v_scale,
    v_zero,
    v_chan,
    D: tl.constexpr,
    SUB: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    FP32: tl.constexpr,
    CLIP: tl.constexpr,
):
    """Online-softmax update with one step (SUB tokens) of a quantized tile, from its bytes
    (``CLIP``: keys at and past ``kv_end`` hidden too)."""
    s = _record_scores(
        q, q_amax, qpos, window, kv_end, c, k_raw, k_scale, k_zero, k_tok, D, SUB, KEY_BITS,
        FP32, CLIP,
    )  # fmt: skip
    p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)

    v_codes = unpack_loaded(v_raw, SUB, D, VALUE_BITS)  # [SUB, D]
    pn = p * v_scale.to(tl.float32)[None, :]  # p <= 1: fits fp16 (v_scale is fp16)
    if FP32:
        pv = tl.dot(pn, v_codes.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pn.to(tl.float16), v_codes.to(tl.float16))
    pz = tl.sum(p * v_zero.to(tl.float32)[None, :], axis=1)
    acc += (pv + pz[:, None]) * log8_factor(v_chan)[None, :]
    return m_i, l_i, acc


@triton.jit
def _load_step_phased(
    cache_u8_ptr,
    cache_f16_ptr,
    block,
    head_off,
    part,
    G: tl.constexpr,
    D: tl.constexpr,
    SUB: tl.constexpr,
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
    RAW_KEYS: tl.constexpr,
):
    """Loads of one step (part ``part`` of the tile in ``block``) for 4-bit keys, split by
    token parity (the two nibbles of a key byte are tokens 2m and 2m+1), and value channel
    scales split by channel phase; ``raw`` as :func:`_load_step`."""
    NBK: tl.constexpr = SUB // 2
    PV: tl.constexpr = 8 // VALUE_BITS
    NBV: tl.constexpr = D // PV  # bytes per value row == channels per phase
    rec = block.to(tl.int64) * head_off[0] + head_off[1]
    u8 = cache_u8_ptr + rec
    f16 = cache_f16_ptr + rec // 2
    d = tl.arange(0, D)
    mm = tl.arange(0, NBK)
    nv = tl.arange(0, NBV)
    k_off = OFF_KC + part * NBK + d[:, None] * (G // 2) + mm[None, :]
    k_raw = tl.load(u8 + k_off)  # [D, NBK] uint8
    k_scale = tl.load(f16 + OFF_KS // 2 + d)
    k_zero = tl.load(f16 + OFF_KZ // 2 + d)
    even = part * SUB + 2 * mm
    k_tok0 = tl.load(u8 + OFF_KT + even)  # log8 codes
    k_tok1 = tl.load(u8 + OFF_KT + even + 1)
    v_off = OFF_VC + even[:, None] * NBV + nv[None, :]
    v_raw0 = tl.load(u8 + v_off)  # [NBK, NBV] uint8, rows 2m
    v_raw1 = tl.load(u8 + v_off + NBV)  # rows 2m + 1
    v_scale0 = tl.load(f16 + OFF_VS // 2 + even)
    v_scale1 = tl.load(f16 + OFF_VS // 2 + even + 1)
    v_zero0 = tl.load(f16 + OFF_VZ // 2 + even)
    v_zero1 = tl.load(f16 + OFF_VZ // 2 + even + 1)
    v_chan0 = tl.load(u8 + OFF_VCS + PV * nv)  # log8 codes
    v_chan1 = tl.load(u8 + OFF_VCS + PV * nv + 1)
    if PV == 4:
        v_chan2 = tl.load(u8 + OFF_VCS + PV * nv + 2)
        v_chan3 = tl.load(u8 + OFF_VCS + PV * nv + 3)
    else:
        v_chan2 = v_chan0
        v_chan3 = v_chan1
    raw = block < 0  # False
    if RAW_KEYS:
        raw = (tl.load(u8 + OFF_FL) & 1) != 0
    return (
        k_raw,
        k_scale,
        k_zero,
        k_tok0,
        k_tok1,
        v_raw0,
        v_raw1,
        v_scale0,
        v_scale1,
        v_zero0,
        v_zero1,
        v_chan0,
        v_chan1,
        v_chan2,
        v_chan3,
        raw,
    )


@triton.jit
def _query_for(raw, qs, q_amax, qos, qo_amax, RAW_KEYS: tl.constexpr):
    """The scaled query rows and their scales a tile is scored with: the un-rotated ones
    (``qos``, ``qo_amax``) for a tile whose keys are stored unrotated, else the rotated ones."""
    if RAW_KEYS:
        return tl.where(raw, qos, qs), tl.where(raw, qo_amax, q_amax)
    else:
        return qs, q_amax


@triton.jit
def _pv_dot(pn0, pn1, c0, c1, FP32: tl.constexpr):
    if FP32:
        return tl.dot(pn0, c0.to(tl.float32), input_precision="ieee") + tl.dot(
            pn1, c1.to(tl.float32), input_precision="ieee"
        )
    else:
        return tl.dot(pn0.to(tl.float16), c0) + tl.dot(pn1.to(tl.float16), c1)


@triton.jit
def _attend_step_phased(
    q,
    q_amax,
    qpos,
    window,
    kv_end,
    c,
    masked,
    m_i,
    l_i,
    acc0,
    acc1,
    acc2,
    acc3,
    k_raw,
    k_scale,
    k_zero,
    k_tok0,
    k_tok1,
    v_raw0,
    v_raw1,
    v_scale0,
    v_scale1,
    v_zero0,
    v_zero1,
    v_chan0,
    v_chan1,
    v_chan2,
    v_chan3,
    SUB: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    FP32: tl.constexpr,
    CLIP: tl.constexpr,
):
    """One step for 4-bit keys without any register reshuffle: the low and high nibbles of the
    key bytes are the even and odd tokens (softmax does not care about order), each value bit
    offset is a channel phase with its own accumulator (interleaved once, after the loop).
    ``masked``: some key of the step is hidden from some row (causal, window, or at and past
    ``kv_end`` with ``CLIP``); else the per-element masks are skipped."""
    NBK: tl.constexpr = SUB // 2
    mm = tl.arange(0, NBK)
    s0, s1 = _phased_scores(q, q_amax, k_raw, k_scale, k_zero, k_tok0, k_tok1, FP32)
    if masked:
        pos0 = c * SUB + 2 * mm
        s0 = tl.where(_visible(pos0, qpos, window, kv_end, CLIP), s0, float("-inf"))
        s1 = tl.where(_visible(pos0 + 1, qpos, window, kv_end, CLIP), s1, float("-inf"))
    m_new, alpha, p0, p1, l_i = _phased_softmax(s0, s1, m_i, l_i)

    # p <= 1 and v_scale is fp16, so p * v_scale fits fp16 without normalization.
    pn0 = p0 * v_scale0.to(tl.float32)[None, :]
    pn1 = p1 * v_scale1.to(tl.float32)[None, :]
    pz = tl.sum(p0 * v_zero0.to(tl.float32)[None, :], axis=1)
    pz += tl.sum(p1 * v_zero1.to(tl.float32)[None, :], axis=1)
    if VALUE_BITS == 2:
        a0, a1, a2, a3 = unpack_crumbs(v_raw0)
        b0, b1, b2, b3 = unpack_crumbs(v_raw1)
        t0 = _pv_dot(pn0, pn1, a0, b0, FP32)
        t1 = _pv_dot(pn0, pn1, a1, b1, FP32)
        t2 = _pv_dot(pn0, pn1, a2, b2, FP32)
        t3 = _pv_dot(pn0, pn1, a3, b3, FP32)
        acc2 = acc2 * alpha[:, None] + (t2 + pz[:, None]) * log8_factor(v_chan2)[None, :]
        acc3 = acc3 * alpha[:, None] + (t3 + pz[:, None]) * log8_factor(v_chan3)[None, :]
    else:
        a0, a1 = unpack_nibbles(v_raw0)
        b0, b1 = unpack_nibbles(v_raw1)
        t0 = _pv_dot(pn0, pn1, a0, b0, FP32)
        t1 = _pv_dot(pn0, pn1, a1, b1, FP32)
    acc0 = acc0 * alpha[:, None] + (t0 + pz[:, None]) * log8_factor(v_chan0)[None, :]
    acc1 = acc1 * alpha[:, None] + (t1 + pz[:, None]) * log8_factor(v_chan1)[None, :]
    return m_new, l_i, acc0, acc1, acc2, acc3


def default_launch(
    decode: bool = True,
    head_dim: int = 128,
    group_size: int = 128,
    bits: tuple[int, int] | None = None,
) -> dict[str, int]:
    """Launch parameters of the untuned kernel (what an engine running CUDA graphs gets).

    Chosen from an H200 sweep of every config (``python -m kvarn_kernels.bench --sweep``,
    2026-11-30, docs/kernels.md): for decode, whole tiles per step (SUB = G up to 128) and few
    warps, since each step's cross-warp reductions and operand staging cost barriers: 4 warps at
    head_dim 128 (808 GB/s at batch 64, 16K context, against 413 with 8 warps and register
    prefetch), 2 at head_dim 64 (552 against 124). head_dim 256 (not swept) halves SUB and keeps
    8 warps, to stay in registers (with 4 it spills). Multi-query blocks (up to 64 rows) keep
    the earlier 8 warps. The 4-bit-key path loads each step as it goes (no register prefetch:
    faster in that sweep, and no spills); the generic path prefetches one step. A second sweep
    (2026-11-30, docs/results/h200-2026-11-30d) timed software-pipelined configs: 2 stages win
    at head_dim 128 only.

    ``bits``: the preset's (key bits, value bits). Multi-query blocks of ``kvarn_k4v2`` at
    head_dim 128 run SUB 64 with 4 warps (H200, 2026-12-04, batch 64 at 16K context, through
    ``bench --sweep verify``: a 16-token block, 64 rows, 3,479 us against 4,967 with 8 warps,
    1,068 against 1,305 at batch 16; a 5-token block 5,789 against 9,775); SUB 128 gave NaN
    with 4 warps and an illegal memory access on 64-row blocks, so multi-query blocks keep
    SUB <= 64. Other presets and head sizes keep 8 warps (not timed).
    """
    if INTERPRET:
        return {"SUB": 32, "num_warps": 4, "num_stages": 1}
    sub = min(group_size, 128 if head_dim <= 128 else 64)
    if decode:
        warps = 2 if head_dim <= 64 else 4 if head_dim <= 128 else 8
        # Two stages (the next step's codes in flight through cp.async) at head_dim 128 only:
        # +5% there (842 against 799 GB/s at batch 64, 725 against 686 at batch 16), -12% at 64.
        stages = 2 if 64 < head_dim <= 128 else 1
        return {"SUB": sub, "num_warps": warps, "num_stages": stages}
    warps = 4 if bits == (4, 2) and head_dim == 128 else 8
    return {"SUB": min(sub, 64), "num_warps": warps, "num_stages": 1}


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"SUB": 32}, num_warps=4, num_stages=1)]
    cfg = triton.Config
    return [
        cfg({"SUB": 128}, num_warps=4, num_stages=1),
        cfg({"SUB": 128}, num_warps=2, num_stages=1),
        cfg({"SUB": 128}, num_warps=8, num_stages=1),
        cfg({"SUB": 64}, num_warps=4, num_stages=1),
        cfg({"SUB": 64}, num_warps=2, num_stages=1),
        cfg({"SUB": 64}, num_warps=4, num_stages=1, maxnreg=128),
        cfg({"SUB": 32}, num_warps=4, num_stages=1),
        # Software pipelining (cp.async into shared memory: step c + 1's bytes in flight while
        # step c computes, without the registers a manual prefetch costs): timed 2026-11-30.
        cfg({"SUB": 128}, num_warps=4, num_stages=2),
        cfg({"SUB": 128}, num_warps=4, num_stages=3),
        cfg({"SUB": 64}, num_warps=4, num_stages=3),
        cfg({"SUB": 128}, num_warps=2, num_stages=2),
        cfg({"SUB": 64}, num_warps=2, num_stages=3),
        # Register caps for 3 CTAs per SM instead of 2 (Nsight Compute, 2026-11-30: the default
        # runs at 2 warps per scheduler, latency-bound). Timed 2026-11-30: 25% slower than the
        # default at batch 64, 16K (the spills they force cost more than the occupancy gains).
        cfg({"SUB": 128}, num_warps=4, num_stages=2, maxnreg=168),
        cfg({"SUB": 64}, num_warps=4, num_stages=2, maxnreg=168),
    ]


def _prune(
    configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
) -> list[triton.Config]:
    g = named_args.get("G", kwargs.get("G"))
    keep = [c for c in configs if not isinstance(g, int) or c.kwargs["SUB"] <= g]
    return keep or configs[:1]


# Integers that change from step to step are not specialized (Triton would otherwise compile a
# variant for 1 and for multiples of 16 mid-serving), nor is the alignment of the per-sequence
# metadata (read one scalar per program; an engine passes row slices of its tables, whose
# starts move with the batch: kvarn-vllm's batch-invariant runs of verify blocks start at any
# row; with key_lens_ptr specialized, a batch-invariant H200 engine compiled this kernel
# mid-serving, most likely on such a run, 2026-12-02). ``part_splits`` follows the fast path's
# split count, which follows the batch (with ``split_batch``, the step's request count): an
# H200 test compiled a variant after warm-up while it was specialized (2026-12-03). Strides of
# the cache and staging are fixed per engine and keep their specialization (vectorized loads).
_STEP_VARYING = ("num_splits", "split_steps", "part_splits", "window", "stride_bt")
_METADATA = (
    "qstart_ptr",
    "block_table_ptr",
    "seq_lens_ptr",
    "qlens_ptr",
    "slots_ptr",
    "sink_lens_ptr",
    "sink_slots_ptr",
    "key_lens_ptr",
)


@triton.jit(do_not_specialize=_STEP_VARYING, do_not_specialize_on_alignment=_METADATA)
def attention_partial_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    qstart_ptr,
    cache_u8_ptr,
    cache_f16_ptr,
    stride_cb,
    stride_ch,
    stage_ptr,
    stride_ss,
    stride_skv,
    stride_sp,
    stride_sh,
    block_table_ptr,
    stride_bt,
    seq_lens_ptr,
    qlens_ptr,
    slots_ptr,
    sink_lens_ptr,
    sink_slots_ptr,
    key_lens_ptr,
    fk_ptr,
    fv_ptr,
    pq_ptr,
    pa_ptr,
    stride_fkt,
    stride_fkh,
    stride_fvt,
    stride_fvh,
    acc_ptr,
    ml_ptr,
    num_q_heads,
    num_splits,
    split_steps,
    part_splits,
    split0,
    qk_scale,
    window,
    rsqrt_d,
    G: tl.constexpr,
    D: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    KSG: tl.constexpr,
    KSINK: tl.constexpr,
    VWIN: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DECODE: tl.constexpr,
    FP32: tl.constexpr,
    SUB: tl.constexpr,
    PHASED: tl.constexpr,
    FRESH: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    OFF_FL: tl.constexpr,
    RAW_KEYS: tl.constexpr,
    QUANT: tl.constexpr,
    PREPARED: tl.constexpr,
):
    """Partial attention of one (sequence, KV head, query block, split).

    ``split_steps > 0``: split s covers the steps ``[s, s + 1) * split_steps`` (batch-invariant
    mode), else the visible steps are cut into ``num_splits`` equal parts.

    ``FRESH``: the queries' own positions ``[seq_len - nq, seq_len)`` are read from ``fk`` /
    ``fv`` ``[num_q_tokens, Hkv, D]`` (this step's K/V, rotated frame; a query's row holds its
    own token), the positions before them as stored (records, sink rows, staging).

    Writes ``acc`` ``[num_q_tokens, Hq, part_splits, D]`` (unnormalized, rotated frame) and
    ``ml`` ``[num_q_tokens, Hq, part_splits, 2]`` (running max in log2 units, softmax
    denominator), split ``s`` at index ``split0 + s``.

    ``QUANT=False`` skips the quantized tiles: only the sink rows, staging and fresh K/V are
    attended (the decode launcher's fast path attends the tiles with its own kernel and merges
    the two partials). ``PREPARED`` (decode, with ``QUANT=False``): the query rows come from
    ``pq`` / ``pa``, the fast kernel's prepared rows (:func:`kvarn_kernels.attention.prep.
    prepare_queries`), instead of being rotated here.

    ``RAW_KEYS``: a tile's record may hold its keys in their own channels (its
    ``KEYS_UNROTATED`` flag); such a tile is scored with the un-rotated query.

    Staging (:func:`kvarn_kernels.staging_view`): keys at rows ``staging_rows(p, KSG, KSINK)``,
    values ``stride_skv`` further at rows ``staging_rows(p, SG, SINK_ROWS)``. ``VWIN``:
    values-only exact windows: the sink tile and positions ``[qlen, key_lens)`` take their keys
    from their records and only their values from staging (``key_lens``: per sequence, where
    the exact keys start).
    """
    seq = tl.program_id(0)
    hkv = tl.program_id(1)
    qblk = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
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
        if PREPARED:
            # The rows kvarn_kernels.attention.prep prepared for the fast decode kernel (the
            # same arithmetic, rounded to fp16): qs [T, F, Hq, D], qa [T, F, Hq], frame 0
            # rotated, frame 1 (RAW_KEYS) as it comes. Saves each staged split the rotation.
            FRAMES: tl.constexpr = 2 if RAW_KEYS else 1
            base = tok * (FRAMES * num_q_heads) + head
            qs = tl.load(pq_ptr + base[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            qs = qs.to(tl.float32)
            q_amax = tl.load(pa_ptr + base, mask=row_ok, other=1.0)
            qo_amax = q_amax
            qos = qs
            if RAW_KEYS:
                qos = tl.load(
                    pq_ptr + (base + num_q_heads)[:, None] * D + d[None, :],
                    mask=row_ok[:, None],
                    other=0.0,
                ).to(tl.float32)
                qo_amax = tl.load(pa_ptr + base + num_q_heads, mask=row_ok, other=1.0)
        else:
            q_off = tok[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
            # Tiles whose keys are stored unrotated are scored with the query as it comes.
            qo = q * qk_scale
            # Into the rotated frame, with the softmax scale and log2(e) folded in.
            q = fwht_rows(q, BLOCK_M, D) * (rsqrt_d * qk_scale)
            # Quantized tiles see the rows divided by their largest entry, |q| <= 1, so
            # q * k_scale (k_scale is fp16) fits fp16 without a per-tile reduction; q_amax is
            # applied after.
            qs, q_amax = unit_rows(q)
            qo_amax = q_amax
            qos = qs
            if RAW_KEYS:
                qos, qo_amax = unit_rows(qo)

        # Step c covers positions [c*SUB, (c+1)*SUB): part c % (G/SUB) of tile c // (G/SUB) for
        # c < qlen / SUB (qlen is a multiple of G), staged tokens after.  Only steps some row of
        # the block can see are walked.
        PARTS: tl.constexpr = G // SUB
        n_quant = qlen // SUB
        last_q = tl.minimum(nq, qblk * BLOCK_Q + BLOCK_Q) - 1
        q_lo = seq_len - nq + qblk * BLOCK_Q  # positions of the block's first and last queries
        q_hi = seq_len - nq + last_q
        hi = q_hi // SUB + 1
        lo = tl.maximum(q_lo - window + 1, 0) // SUB
        lo = tl.where(window > 0, lo, 0)
        # Steps of tile 0 read from the sink rows of staging when the sequence has its exact
        # first tile there (then its quantized record, kept for prefix-cache sharing, is skipped).
        n_sink = qlen * 0
        if SINK_ROWS > 0:
            n_sink = tl.minimum(tl.load(sink_lens_ptr + seq), qlen) // SUB
        if split_steps > 0:
            # Batch-invariant: split s covers steps [s * split_steps, (s + 1) * split_steps)
            # of every sequence, whatever the batch or the query block.
            c0 = tl.maximum(split * split_steps, lo)
            c1 = tl.minimum((split + 1) * split_steps, hi)
        else:
            per = tl.cdiv(hi - lo, num_splits)
            c0 = lo + split * per
            c1 = tl.minimum(c0 + per, hi)
        # The steps of the sink rows [cs0, cs1) and of the staged tokens [ct0, ct1) a split walks:
        # both [c0, c1), or without the quantized tiles (QUANT=False) equal shares of the sink
        # steps [lo, n_sink) followed by the staged ones [n_quant, hi): they depend on the row
        # and num_splits only, which batch-invariant mode fixes (a split per staged tile).
        cs0 = c0
        cs1 = c1
        ct0 = c0
        ct1 = c1
        if not QUANT:
            n_sink_steps = tl.maximum(n_sink - lo, 0)
            st0 = tl.maximum(n_quant, lo)
            if FRESH:
                # The queries' own positions from kv_end on are this pass's too, also where
                # the step's store already gave them records (a chunk that completed tiles).
                st0 = tl.maximum(tl.minimum(n_quant, (seq_len - nq) // SUB), lo)
            n_steps = n_sink_steps + tl.maximum(hi - st0, 0)
            vper = tl.cdiv(n_steps, num_splits)
            v0 = tl.minimum(split * vper, n_steps)
            v1 = tl.minimum(v0 + vper, n_steps)
            cs0 = lo + tl.minimum(v0, n_sink_steps)
            cs1 = lo + tl.minimum(v1, n_sink_steps)
            ct0 = st0 + tl.maximum(v0 - n_sink_steps, 0)
            ct1 = st0 + tl.maximum(v1 - n_sink_steps, 0)

        m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        head_off = (stride_cb, hkv.to(tl.int64) * stride_ch)
        # Keys at and past kv_end come from the step's K/V (FRESH): the records and staging
        # give only the positions before the queries' own.
        kv_end = seq_len
        c_end = tl.minimum(c1, n_quant)
        c_stage = ct1
        if FRESH:
            kv_end = seq_len - nq
            c_end = tl.minimum(c1, tl.cdiv(tl.minimum(qlen, kv_end), SUB))
            c_stage = tl.minimum(ct1, tl.cdiv(kv_end, SUB))
        cq0 = tl.maximum(c0, n_sink)
        if not QUANT:
            c_end = cq0  # the quantized tiles are another kernel's
        # The cache is read once, front to back.  The 4-bit-key (phased) path loads each step
        # as it goes; the generic path prefetches one step into registers (the packed bytes of
        # step c + 1 are in flight while step c computes, and the block id one step further).
        if PHASED:
            NBV: tl.constexpr = D * VALUE_BITS // 8
            acc0 = tl.zeros([BLOCK_M, NBV], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_M, NBV], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, NBV], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_M, NBV], dtype=tl.float32)
            # No software prefetch here (the H200 sweep: faster, and no spills): the packed
            # words go straight from the loads to the unpacking, and the other resident CTAs
            # hide the latency.
            for c in range(cq0, c_end):
                blkc = tl.load(bt_row + c // PARTS)
                (kr, ks, kz, kt0, kt1, vr0, vr1, vs0, vs1, vz0, vz1, vc0, vc1, vc2, vc3, raw) = (
                    _load_step_phased(
                        cache_u8_ptr,
                        cache_f16_ptr,
                        blkc,
                        head_off,
                        c % PARTS,
                        G,
                        D,
                        SUB,
                        VALUE_BITS,
                        OFF_KC,
                        OFF_KS,
                        OFF_KZ,
                        OFF_KT,
                        OFF_VC,
                        OFF_VCS,
                        OFF_VS,
                        OFF_VZ,
                        OFF_FL,
                        RAW_KEYS,
                    )
                )
                # Every key of a step before the block's first query, and inside the window
                # of its last one, is visible to every row: no per-element masks (decode steps
                # over quantized tiles are all such steps unless a window cuts them).
                masked = (c * SUB + SUB - 1 > q_lo) | ((window > 0) & (c * SUB <= q_hi - window))
                if FRESH:
                    masked = masked | (c * SUB + SUB > kv_end)
                qsel, asel = _query_for(raw, qs, q_amax, qos, qo_amax, RAW_KEYS)
                m_i, l_i, acc0, acc1, acc2, acc3 = _attend_step_phased(
                    qsel,
                    asel,
                    qpos,
                    window,
                    kv_end,
                    c,
                    masked,
                    m_i,
                    l_i,
                    acc0,
                    acc1,
                    acc2,
                    acc3,
                    kr,
                    ks,
                    kz,
                    kt0,
                    kt1,
                    vr0,
                    vr1,
                    vs0,
                    vs1,
                    vz0,
                    vz1,
                    vc0,
                    vc1,
                    vc2,
                    vc3,
                    SUB,
                    VALUE_BITS,
                    FP32,
                    FRESH,
                )
            # Channel d = PV * n + phase: interleave the phase accumulators once.
            if VALUE_BITS == 2:
                acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [BLOCK_M, D])
            else:
                acc = tl.reshape(tl.join(acc0, acc1), [BLOCK_M, D])
        else:
            ok = cq0 < c_end
            blk = tl.load(bt_row + cq0 // PARTS, mask=ok, other=0)
            k_raw, k_scale, k_zero, k_tok, v_raw, v_scale, v_zero, v_chan, raw = _load_step(
                cache_u8_ptr,
                cache_f16_ptr,
                blk,
                head_off,
                cq0 % PARTS,
                ok,
                G,
                D,
                SUB,
                KEY_BITS,
                VALUE_BITS,
                OFF_KC,
                OFF_KS,
                OFF_KZ,
                OFF_KT,
                OFF_VC,
                OFF_VCS,
                OFF_VS,
                OFF_VZ,
                OFF_FL,
                RAW_KEYS,
            )
            ok1 = cq0 + 1 < c_end
            blk1 = tl.load(bt_row + (cq0 + 1) // PARTS, mask=ok1, other=0)
            for c in range(cq0, c_end):
                k_raw1, k_scale1, k_zero1, k_tok1, v_raw1, v_scale1, v_zero1, v_chan1, raw1 = (
                    _load_step(
                        cache_u8_ptr,
                        cache_f16_ptr,
                        blk1,
                        head_off,
                        (c + 1) % PARTS,
                        c + 1 < c_end,
                        G,
                        D,
                        SUB,
                        KEY_BITS,
                        VALUE_BITS,
                        OFF_KC,
                        OFF_KS,
                        OFF_KZ,
                        OFF_KT,
                        OFF_VC,
                        OFF_VCS,
                        OFF_VS,
                        OFF_VZ,
                        OFF_FL,
                        RAW_KEYS,
                    )
                )
                blk1 = tl.load(bt_row + (c + 2) // PARTS, mask=c + 2 < c_end, other=0)
                qsel, asel = _query_for(raw, qs, q_amax, qos, qo_amax, RAW_KEYS)
                m_i, l_i, acc = _attend_step(
                    qsel,
                    asel,
                    qpos,
                    window,
                    kv_end,
                    c,
                    m_i,
                    l_i,
                    acc,
                    k_raw,
                    k_scale,
                    k_zero,
                    k_tok,
                    v_raw,
                    v_scale,
                    v_zero,
                    v_chan,
                    D,
                    SUB,
                    KEY_BITS,
                    VALUE_BITS,
                    FP32,
                    FRESH,
                )
                k_raw, k_scale, k_zero, k_tok = k_raw1, k_scale1, k_zero1, k_tok1
                v_raw, v_scale, v_zero, v_chan, raw = v_raw1, v_scale1, v_zero1, v_chan1, raw1

        stage = stage_ptr + slot * stride_ss + hkv.to(tl.int64) * stride_sh
        # The sink rows may be another slot's: a request that hit the prefix cache on tile 0
        # reads the exact tile 0 its owner wrote (kvarn-vllm decides which, per step).
        sink_stage = stage
        if SINK_ROWS > 0:
            sink_slot = tl.load(sink_slots_ptr + seq).to(tl.int64)
            sink_stage = stage_ptr + sink_slot * stride_ss + hkv.to(tl.int64) * stride_sh
        # Values-only windows: steps before n_key (the sink tile, [qlen, key_lens)) score keys
        # from their records; the exact keys (the key ring, own slot) start at n_key.
        n_key = n_quant * 0
        sink_keys = sink_stage
        if VWIN:
            n_key = tl.load(key_lens_ptr + seq) // SUB
            sink_keys = stage
            for c in range(cs0, tl.minimum(tl.minimum(cs1, n_sink), n_key)):
                m_i, l_i, acc = _window_step(
                    qs, q_amax, qos, qo_amax, qpos, window, kv_end, c, m_i, l_i, acc,
                    cache_u8_ptr, cache_f16_ptr, bt_row, head_off, sink_stage + stride_skv,
                    stride_sp, G, D, SUB, SG, SINK_ROWS, KEY_BITS, OFF_KC, OFF_KS, OFF_KZ,
                    OFF_KT, OFF_FL, RAW_KEYS, FP32, FRESH,
                )  # fmt: skip
            for c in range(tl.maximum(ct0, n_quant), tl.minimum(c_stage, n_key)):
                m_i, l_i, acc = _window_step(
                    qs, q_amax, qos, qo_amax, qpos, window, kv_end, c, m_i, l_i, acc,
                    cache_u8_ptr, cache_f16_ptr, bt_row, head_off, stage + stride_skv,
                    stride_sp, G, D, SUB, SG, SINK_ROWS, KEY_BITS, OFF_KC, OFF_KS, OFF_KZ,
                    OFF_KT, OFF_FL, RAW_KEYS, FP32, FRESH,
                )  # fmt: skip
        # The unquantized steps take the query back from qs (within an ulp), so the fp32 query
        # is not held in registers through the quantized loop.
        q = qs * q_amax[:, None]
        for c in range(tl.maximum(cs0, n_key), tl.minimum(cs1, n_sink)):
            m_i, l_i, acc = _dense_step(
                q, qpos, window, c, m_i, l_i, acc, sink_keys, sink_stage + stride_skv,
                stride_sp, kv_end, D, SUB, KSG, KSINK, SG, SINK_ROWS, FP32,
            )  # fmt: skip
        for c in range(tl.maximum(tl.maximum(ct0, n_quant), n_key), c_stage):
            m_i, l_i, acc = _dense_step(
                q, qpos, window, c, m_i, l_i, acc, stage, stage + stride_skv, stride_sp,
                kv_end, D, SUB, KSG, KSINK, SG, SINK_ROWS, FP32,
            )  # fmt: skip
        if FRESH:
            fk = fk_ptr + hkv.to(tl.int64) * stride_fkh
            fv = fv_ptr + hkv.to(tl.int64) * stride_fvh
            for c in range(tl.maximum(ct0, kv_end // SUB), ct1):
                m_i, l_i, acc = _fresh_step(
                    q,
                    qpos,
                    window,
                    c,
                    m_i,
                    l_i,
                    acc,
                    fk,
                    fv,
                    stride_fkt,
                    stride_fvt,
                    q_first - kv_end,
                    kv_end,
                    seq_len,
                    D,
                    SUB,
                    FP32,
                )

        part = (tok * num_q_heads + head.to(tl.int64)) * part_splits + split0 + split
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


# The same kernel, autotuned over SUB / warps / register caps on its first call per shape
# (opt-in, see kvarn_kernels.attention.launch: tuning benchmarks on the device, which a CUDA
# graph capture cannot contain).
attention_partial_kernel_autotuned = triton.autotune(
    configs=_configs(),
    key=["G", "D", "KEY_BITS", "VALUE_BITS", "BLOCK_M", "FP32", "DECODE"],
    prune_configs_by={"early_config_prune": _prune},
)(attention_partial_kernel)


@triton.jit(do_not_specialize=("num_splits",), do_not_specialize_on_alignment=("qend_ptr",))
def attention_combine_kernel(
    acc_ptr,
    ml_ptr,
    num_q_heads,
    num_splits,
    out_ptr,
    stride_ot,
    stride_oh,
    qend_ptr,
    rsqrt_d,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Merge the splits of one (query token, KV head), un-rotate, write ``out`` rows."""
    COMBINE_CHUNK: tl.constexpr = 8
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
        mask = hmask[:, None] & (sp < num_splits)[None, :]
        part = (tok * num_q_heads + head)[:, None] * num_splits + sp[None, :]  # [BLOCK_H, BLOCK_S]
        m = tl.load(ml_ptr + part * 2, mask=mask, other=float("-inf"))
        denom_part = tl.load(ml_ptr + part * 2 + 1, mask=mask, other=0.0)
        m_max = tl.max(m, axis=1)
        m_max = tl.where(hmask, m_max, 0.0)
        w = tl.exp2(m - m_max[:, None])
        denom = tl.sum(w * denom_part, axis=1)
        # 1 where nothing was attended (a padding row with seq_len 0): the output is then 0.
        denom = tl.where(hmask & (denom > 0), denom, 1.0)
        d = tl.arange(0, D)
        # The partial outputs in chunks of splits: all BLOCK_S of them at once would hold
        # BLOCK_H x BLOCK_S x D fp32 values (512 per thread at head_dim 256: spills).
        o = tl.zeros([BLOCK_H, D], dtype=tl.float32)
        c = tl.arange(0, COMBINE_CHUNK)
        for s0 in range(0, num_splits, COMBINE_CHUNK):
            cmask = hmask[:, None] & (s0 + c < num_splits)[None, :]
            cpart = (tok * num_q_heads + head)[:, None] * num_splits + s0 + c[None, :]
            cm = tl.load(ml_ptr + cpart * 2, mask=cmask, other=float("-inf"))
            cw = tl.exp2(cm - m_max[:, None])
            acc = tl.load(
                acc_ptr + cpart[:, :, None] * D + d[None, None, :],
                mask=cmask[:, :, None],
                other=0.0,
            )
            o += tl.sum(cw[:, :, None] * acc, axis=1)
        o = o / denom[:, None]
        o = fwht_rows(o, BLOCK_H, D) * rsqrt_d
        dst = out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, round_to(o, out_ptr.dtype.element_ty), mask=hmask[:, None])
