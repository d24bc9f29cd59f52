"""Triton kernels of the store: quantize completed tiles, write open tokens to staging."""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._triton import (
    exp_f32,
    extremes,
    fwht_rows,
    log8_encode,
    log8_factor,
    log_f32,
    pack_rows,
    rint_f32,
    round_to,
    staging_rows,
)

__all__ = ["quantize_tiles_kernel", "stage_tokens_kernel"]

_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)
# kvarn_math.ranges: INPUT_BOUND, PRESCALE_FROM, SHIFT_FROM
_INPUT_BOUND: tl.constexpr = tl.constexpr(2.0**100)
_PRESCALE_FROM: tl.constexpr = tl.constexpr(48)
_SHIFT_FROM: tl.constexpr = tl.constexpr(15)


@triton.jit
def _std(x, AXIS: tl.constexpr, N: tl.constexpr):
    # NumPy's x.std(axis, ddof=1): mean = sum / n, then sum of squared deviations / (n - 1).
    mean = tl.div_rn(tl.sum(x, axis=AXIS), N * 1.0)
    if AXIS == 0:
        dev = x - mean[None, :]
    else:
        dev = x - mean[:, None]
    return tl.sqrt_rn(tl.div_rn(tl.sum(dev * dev, axis=AXIS), N - 1.0))


@triton.jit
def _ratio(std):
    # max / min of a state's row or column stds (kvarn_math.varnorm.imbalance's terms)
    hi, lo = extremes(std, 0)
    return tl.div_rn(hi, tl.maximum(lo, 1e-8))


@triton.jit
def _variance_normalize(
    raw, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, PRECISE: tl.constexpr
):
    """kvarn_math.varnorm.variance_normalize of one tile ``[R, C]`` fp32.

    Returns ``(row_scale [R], col_scale [C])`` of the least imbalanced state.

    The state is ``x / (r c^T)``; its stds are taken from one-sided products instead of the
    state itself: its rows are ``x / c`` scaled by ``1 / r``, so their stds are those of
    ``x / c`` over ``r``, and its columns are ``x / r`` scaled by ``1 / c``. Each sweep then
    makes two tile products and two std passes (one per axis), where kvarn-math's order makes
    two full states and three passes: the same values in exact arithmetic, rounded differently.
    """
    ms = tl.div_rn(tl.sum(tl.sum(raw * raw, axis=1), axis=0), R * C * 1.0)
    rms = tl.sqrt_rn(ms)
    rms = tl.where(rms > 0, rms, 1.0)
    x = tl.div_rn(raw, rms)
    log_r = tl.zeros([R], dtype=tl.float32)
    log_c = tl.zeros([C], dtype=tl.float32)
    std_c = _std(x, 0, R)  # the state's column stds (r = c = 1)
    best = _ratio(std_c) + _ratio(_std(x, 1, C))
    best_r = log_r
    best_c = log_c
    for _ in range(ITERS):
        clamped = tl.minimum(tl.maximum(std_c, 1e-3), 1e3)
        log_c = tl.minimum(tl.maximum(log_c + log_f32(clamped, PRECISE), -0.3), 10.0)
        inv_c = exp_f32(-log_c, PRECISE)
        std_y = _std(x * inv_c[None, :], 1, C)  # rows of x / c
        clamped = tl.minimum(tl.maximum(std_y * exp_f32(-log_r, PRECISE), 1e-3), 1e3)
        log_r = tl.minimum(tl.maximum(log_r + log_f32(clamped, PRECISE), -0.3), 10.0)
        # the new state x / (r c^T): rows from x / c again, columns from x / r
        inv_r = exp_f32(-log_r, PRECISE)
        std_c = _std(x * inv_r[:, None], 0, R) * inv_c
        score = _ratio(std_c) + _ratio(std_y * inv_r)
        better = score < best
        best = tl.where(better, score, best)
        best_r = tl.where(better, log_r, best_r)
        best_c = tl.where(better, log_c, best_c)
    return exp_f32(best_r, PRECISE) * rms, exp_f32(best_c, PRECISE)


@triton.jit
def _balance(raw, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, PRECISE: tl.constexpr):
    """The encoder's front half (kvarn_math.tile.encode_tiles): normalize, round the column
    factors to their log8 codes, and divide the raw tile by ``row_scale x log8(code)``.

    Returns ``(balanced [R, C], row_scale [R], column codes int32 [C])``.
    """
    row, col = _variance_normalize(raw, R, C, ITERS, PRECISE)
    codes = log8_encode(col, PRECISE)
    col_q = log8_factor(codes, PRECISE)
    return tl.div_rn(raw, row[:, None] * col_q[None, :]), row, codes


@triton.jit
def _rtn_rows(b, BITS: tl.constexpr, PRECISE: tl.constexpr):
    """kvarn_math.rtn.quantize_rows: returns ``(codes int32 [R, C], step [R], lo [R])``."""
    levels = (1 << BITS) - 1.0
    hi, lo = extremes(b, 1)
    step = tl.div_rn(hi - lo, levels)
    safe = tl.where(step > 0, step, 1.0)
    scaled = tl.div_rn(b - lo[:, None], safe[:, None])
    codes = tl.minimum(tl.maximum(rint_f32(scaled, PRECISE), 0.0), levels)
    codes = tl.where(step[:, None] > 0, codes, 0.0)
    return codes.to(tl.int32), step, lo


@triton.jit
def _fp16(x):
    return tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX).to(tl.float16)


@triton.jit
def _exponent(x):
    # kvarn_math.ranges.float_exponent: floor(log2 x) of x >= 0 from its exponent bits
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2(e):
    # kvarn_math.ranges.pow2: 2^e for integers e in [-126, 127], exact
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def bound_input(x):
    """kvarn_math.ranges.INPUT_BOUND in saturate mode: ``x`` clipped to +-2^100 (NaN stays)."""
    return tl.where(tl.abs(x) > _INPUT_BOUND, tl.where(x > 0, _INPUT_BOUND, -_INPUT_BOUND), x)


@triton.jit
def _encode_rows(
    x, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, BITS: tl.constexpr, PRECISE
):
    """kvarn_math.tile's ``_encode_rows`` in saturate mode: one half of a record from the tile
    ``x`` ``[R, C]`` (rows quantized). Returns ``(codes int32 [R, C], scale fp16 [R], zero fp16
    [R], column codes int32 [C], overflow)``: tiles past 2^49 are encoded from ``x * 2^-p``,
    and folded row scales past fp16 move powers of two into the column codes
    (kvarn_math.ranges.fit_row_scales); ``overflow``: the tile did not fit and was saturated."""
    x = bound_input(x)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    pre = tl.maximum(_exponent(amax) - _PRESCALE_FROM, 0)
    x = x * _pow2(-pre)
    b, row, col = _balance(x, R, C, ITERS, PRECISE)
    codes, step, lo = _rtn_rows(b, BITS, PRECISE)
    step = step * row
    lo = lo * row
    mag = tl.maximum(step, tl.abs(lo))
    need = tl.maximum(pre + _exponent(tl.max(mag, axis=0)) - _SHIFT_FROM, 0)
    room = (255 - tl.max(col, axis=0)) // 16
    over = need > room
    shift = tl.minimum(need, room)
    factor = _pow2(pre - shift)
    past = over & (mag * factor > _FP16_MAX)
    mult = tl.where(past, tl.div_rn(_FP16_MAX, tl.where(mag > 0, mag, 1.0)), factor)
    return codes, _fp16(step * mult), _fp16(lo * mult), col + 16 * shift, over


@triton.jit
def _quantize_keys(
    k, G: tl.constexpr, D: tl.constexpr, ITERS: tl.constexpr, BITS: tl.constexpr, PRECISE
):
    """Keys ``[G, D]`` as the record holds them: ``(codes int32 [D, G], k_scale fp16 [D],
    k_zero fp16 [D], token codes int32 [G], overflow)`` (rows are channels, quantized over
    tokens)."""
    return _encode_rows(tl.trans(k), D, G, ITERS, BITS, PRECISE)


@triton.jit
def _frame_estimates(
    k,
    k_raw,
    q_row,
    stride_qh,
    hkv,
    rsqrt_d,
    G: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
):
    """kvarn_math.tile.key_frame_estimates of one tile: ``(rotated, raw)`` =
    ``sum_d (sum_i q_i[d]^2) (max_t k[t, d] - min_t k[t, d])^2`` in each frame, over the KV
    head's ``GROUP`` query heads of the query row at ``q_row`` (heads ``stride_qh`` apart): the
    tile's last position's (kvarn_math.tile.frame_query_rows)."""
    hi, lo = extremes(k, 0)
    spread_rot = hi - lo  # [D]
    hi, lo = extremes(k_raw, 0)
    spread_raw = hi - lo
    d = tl.arange(0, D)
    energy_rot = tl.zeros([D], dtype=tl.float32)
    energy_raw = tl.zeros([D], dtype=tl.float32)
    # One live row in a block of 16 (the transform's smallest row block).
    r = tl.arange(0, 16)
    live = r < 1
    for j in tl.static_range(GROUP):
        head = (hkv * GROUP + j).to(tl.int64)
        q = tl.load(
            q_row + head * stride_qh + (r * 0)[:, None] + d[None, :],
            mask=live[:, None],
            other=0.0,
        ).to(tl.float32)
        energy_raw += tl.sum(q * q, axis=0)
        q = fwht_rows(q, 16, D) * rsqrt_d
        energy_rot += tl.sum(q * q, axis=0)
    rotated = tl.sum(energy_rot * spread_rot * spread_rot, axis=0)
    return rotated, tl.sum(energy_raw * spread_raw * spread_raw, axis=0)


@triton.jit
def _load_tile(
    fresh_ptr,
    stride_ft,
    stride_fh,
    stage_ptr,
    stride_ss,
    stride_sp,
    head,
    slot,
    start,
    num_staged,
    fresh_index,
    rsqrt_d,
    G: tl.constexpr,
    D: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    FRESH_ROTATED: tl.constexpr,
):
    """The tile's ``G`` rotated tokens ``[G, D]`` fp32, as rounded to the staging dtype."""
    t = tl.arange(0, G)
    d = tl.arange(0, D)
    from_stage = t < num_staged
    spos = staging_rows(start + t, SG, SINK_ROWS).to(tl.int64)
    stage_off = slot.to(tl.int64) * stride_ss + spos[:, None] * stride_sp + d[None, :]
    staged = tl.load(stage_ptr + stage_off, mask=from_stage[:, None], other=0.0).to(tl.float32)
    row = (fresh_index + t - num_staged).to(tl.int64)
    fresh_off = row[:, None] * stride_ft + head.to(tl.int64) * stride_fh + d[None, :]
    fresh = tl.load(fresh_ptr + fresh_off, mask=(~from_stage)[:, None], other=0.0).to(tl.float32)
    if not FRESH_ROTATED:
        fresh = fwht_rows(bound_input(fresh), G, D) * rsqrt_d
        # Round exactly as the staging write does, so a token quantizes the same way whether it
        # reached its tile through staging or straight from the batch.
        fresh = round_to(fresh, stage_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(from_stage[:, None], staged, fresh)


@triton.jit
def quantize_tiles_kernel(
    key_ptr,
    stride_kt,
    stride_kh,
    value_ptr,
    stride_vt,
    stride_vh,
    stage_ptr,
    stride_ss,
    stride_skv,
    stride_sp,
    stride_sh,
    cache_u8_ptr,
    cache_f16_ptr,
    stride_cb,
    stride_ch,
    tiles_ptr,
    q_ptr,
    stride_qt,
    stride_qh,
    frames_ptr,
    fq_ptr,
    stride_fs,
    stride_ft,
    stride_fh,
    rsqrt_d,
    count_ptr,
    G: tl.constexpr,
    D: tl.constexpr,
    SG: tl.constexpr,
    SINK_ROWS: tl.constexpr,
    KSG: tl.constexpr,
    KSINK: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_FRAME: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    ITERS: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    OFF_FL: tl.constexpr,
    FRESH_ROTATED: tl.constexpr,
    PRECISE: tl.constexpr,
    STAGED_QUERIES: tl.constexpr = False,
    COUNT_OVERFLOW: tl.constexpr = False,
):
    """One program = keys or values of one tile of one KV head: gather, rotate, normalize,
    round, pack, store (grid: tiles x KV heads x 2).

    Tiles no record can hold are stored saturated (kvarn_math.ranges); with
    ``COUNT_OVERFLOW`` each such half-tile adds 1 to the int32 at ``count_ptr``.

    ``tiles`` rows: ``block_id, slot, start_pos, num_staged, fresh_index`` (block -1: skip).
    Byte offsets ``stride_cb``/``stride_ch`` of ``cache_u8``; ``cache_f16`` aliases it.
    Staged keys sit at rows ``staging_rows(p, KSG, KSINK)``, staged values ``stride_skv``
    further at ``staging_rows(p, SG, SINK_ROWS)`` (:func:`kvarn_kernels.staging_view`).

    The keys' frame (``KEY_FRAME``): 0 rotated; 1 chosen per tile and KV head by the smaller
    estimated attention-score error over the queries ``q`` ``[num_tokens, Hq, D]`` (original
    frame) of the tile's last position (kvarn_math.tile.frame_query_rows): its last fresh row;
    when all its tokens were staged, with ``STAGED_QUERIES`` the query staged with that
    position's key (``fq`` ``[num_slots, T, Hq, D]``, :func:`kvarn_kernels.frame_query_shape`),
    without it the row ``fresh_index`` (its request's first of the step)
    (kvarn_math.tile.choose_key_frames); 2 as ``frames`` ``[num_tiles, Hkv]`` int8 says
    (1: the keys' own channels).
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv = tl.program_id(2)  # 0: keys, 1: values (separate programs halve the tile's latency)
    meta = tiles_ptr + tile * 5
    block = tl.load(meta)
    if block >= 0:
        slot = tl.load(meta + 1)
        start = tl.load(meta + 2)
        num_staged = tl.load(meta + 3)
        fresh_index = tl.load(meta + 4)
        rec = block.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch
        u8 = cache_u8_ptr + rec
        f16 = cache_f16_ptr + rec // 2
        g = tl.arange(0, G)
        d = tl.arange(0, D)
        stage_k = stage_ptr + head.to(tl.int64) * stride_sh
        stage_v = stage_k + stride_skv

        if kv == 0:
            # Keys: the tile as [D, G] (rows are channels), quantized per channel over tokens.
            k = _load_tile(
                key_ptr, stride_kt, stride_kh, stage_k, stride_ss, stride_sp, head, slot, start,
                num_staged, fresh_index, rsqrt_d, G, D, KSG, KSINK, FRESH_ROTATED,
            )  # fmt: skip
            raw = head < 0  # False: the rotated frame
            if KEY_FRAME == 1:
                k_raw = fwht_rows(k, G, D) * rsqrt_d  # H / sqrt(D) is its own inverse
                last = fresh_index + tl.maximum(G - num_staged, 1) - 1
                q_row = q_ptr + last.to(tl.int64) * stride_qt
                q_hs = stride_qh
                if STAGED_QUERIES:  # noqa: SIM102 (a compile-time branch around a run-time one)
                    if num_staged >= G:
                        ring = staging_rows(start + G - 1, KSG, KSINK) // G
                        q_row = (
                            fq_ptr + slot.to(tl.int64) * stride_fs + ring.to(tl.int64) * stride_ft
                        )
                        q_hs = stride_fh
                est_rot, est_raw = _frame_estimates(
                    k, k_raw, q_row, q_hs, head, rsqrt_d, G, D, GROUP
                )
                raw = est_raw < est_rot
                k = tl.where(raw, k_raw, k)
            if KEY_FRAME == 2:
                raw = tl.load(frames_ptr + tile * tl.num_programs(1) + head) != 0
                k = tl.where(raw, fwht_rows(k, G, D) * rsqrt_d, k)
            k_codes, k_scale, k_zero, k_col, over = _quantize_keys(
                k, G, D, ITERS, KEY_BITS, PRECISE
            )
            pack_rows(k_codes, u8 + OFF_KC, G * KEY_BITS // 8, D, G, KEY_BITS)
            tl.store(f16 + OFF_KS // 2 + d, k_scale)
            tl.store(f16 + OFF_KZ // 2 + d, k_zero)
            tl.store(u8 + OFF_KT + g, k_col.to(tl.uint8))
            fl = tl.arange(0, 16)
            tl.store(u8 + OFF_FL + fl, tl.where(fl == 0, raw.to(tl.uint8), 0).to(tl.uint8))
        else:
            # Values: the tile as [G, D] (rows are tokens), quantized per token over channels.
            v = _load_tile(
                value_ptr, stride_vt, stride_vh, stage_v, stride_ss, stride_sp, head, slot,
                start, num_staged, fresh_index, rsqrt_d, G, D, SG, SINK_ROWS, FRESH_ROTATED,
            )  # fmt: skip
            v_codes, v_scale, v_zero, v_col, over = _encode_rows(
                v, G, D, ITERS, VALUE_BITS, PRECISE
            )
            pack_rows(v_codes, u8 + OFF_VC, D * VALUE_BITS // 8, G, D, VALUE_BITS)
            tl.store(u8 + OFF_VCS + d, v_col.to(tl.uint8))
            tl.store(f16 + OFF_VS // 2 + g, v_scale)
            tl.store(f16 + OFF_VZ // 2 + g, v_zero)
        if COUNT_OVERFLOW:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if over:
                tl.atomic_add(count_ptr, 1)


@triton.jit(do_not_specialize=("num_rows",))
def stage_tokens_kernel(
    key_ptr,
    stride_kt,
    stride_kh,
    value_ptr,
    stride_vt,
    stride_vh,
    stage_ptr,
    stride_ss,
    stride_skv,
    stride_sp,
    stride_sh,
    writes_ptr,
    num_rows,
    q_ptr,
    stride_qt,
    stride_qh,
    fq_ptr,
    stride_fs,
    stride_ft,
    stride_fh,
    rsqrt_d,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    G: tl.constexpr = 1,
    GROUP: tl.constexpr = 1,
    STAGED_QUERIES: tl.constexpr = False,
):
    """Rotate ``BLOCK_T`` fresh tokens of one KV head and write them to their staging positions.

    ``writes`` rows: ``token_index, slot, staging_pos, key_pos`` (token -1: skip; the value
    goes to row ``staging_pos`` of the value rows, ``stride_skv`` after the key rows, the key to
    row ``key_pos``; a row of -1 is not written). With ``STAGED_QUERIES``, a token whose key
    row is the last of a tile's (``key_pos % G == G - 1``: the tile's last position) also copies
    its ``GROUP`` query heads of this KV head from ``q`` ``[num_tokens, Hq, D]`` to
    ``fq[slot, key_pos // G]`` (:func:`kvarn_kernels.frame_query_shape`), unchanged.
    """
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    r = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = r < num_rows
    token = tl.load(writes_ptr + r * 4, mask=in_range, other=-1)
    live = token >= 0
    slot = tl.load(writes_ptr + r * 4 + 1, mask=live, other=0).to(tl.int64)
    pos = tl.load(writes_ptr + r * 4 + 2, mask=live, other=-1).to(tl.int64)
    kpos = tl.load(writes_ptr + r * 4 + 3, mask=live, other=-1).to(tl.int64)
    tok = token.to(tl.int64)
    d = tl.arange(0, D)
    mask = (pos >= 0)[:, None]
    kmask = (kpos >= 0)[:, None]
    base = stage_ptr + slot[:, None] * stride_ss + head * stride_sh + d[None, :]
    k = tl.load(
        key_ptr + tok[:, None] * stride_kt + head * stride_kh + d[None, :], mask=kmask, other=0.0
    )
    k = fwht_rows(bound_input(k.to(tl.float32)), BLOCK_T, D) * rsqrt_d
    tl.store(base + kpos[:, None] * stride_sp, round_to(k, stage_ptr.dtype.element_ty), mask=kmask)
    v = tl.load(
        value_ptr + tok[:, None] * stride_vt + head * stride_vh + d[None, :], mask=mask, other=0.0
    )
    v = fwht_rows(bound_input(v.to(tl.float32)), BLOCK_T, D) * rsqrt_d
    dst = base + stride_skv + pos[:, None] * stride_sp
    tl.store(dst, round_to(v, stage_ptr.dtype.element_ty), mask=mask)
    if STAGED_QUERIES:
        last = ((kpos >= 0) & (kpos % G == G - 1))[:, None]
        fq = fq_ptr + slot[:, None] * stride_fs + (kpos // G)[:, None] * stride_ft + d[None, :]
        for j in tl.static_range(GROUP):
            hq = head * GROUP + j
            q = tl.load(q_ptr + tok[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=last)
            tl.store(fq + hq * stride_fh, q, mask=last)
