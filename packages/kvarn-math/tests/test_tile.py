import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.hadamard import rotate
from kvarn_math.layout import PRESETS, get_preset
from kvarn_math.log8 import decode_log8, encode_log8, round_log8
from kvarn_math.metrics import relative_error, sqnr_db
from kvarn_math.packing import unpack
from kvarn_math.rtn import quantize_rows
from kvarn_math.testing import kv_tiles, make_kv, presets
from kvarn_math.tile import (
    decode_tiles,
    dequantize_tiles,
    encode_tiles,
    quantize_tiles,
    read_fields,
)
from kvarn_math.varnorm import variance_normalize

# SQNR floors (dB) per bit width on the drawn distributions; 4-bit RTN sits near 20 dB.
MIN_SQNR = {2: 4.0, 3: 9.0, 4: 15.0}


@given(kv_tiles(group_size=st.sampled_from([64, 128])), presets())
def test_roundtrip_quality(sample, preset) -> None:
    if sample.k.shape[-2] != preset.group_size:
        preset = get_preset(f"kvarn_k4v2_g{sample.k.shape[-2]}")
    records = quantize_tiles(sample.k, sample.v, preset)
    k_hat, v_hat = dequantize_tiles(records, preset, sample.k.shape[-1])
    assert np.isfinite(k_hat).all() and np.isfinite(v_hat).all()
    assert sqnr_db(sample.k, k_hat) > MIN_SQNR[preset.key_bits]
    assert sqnr_db(sample.v, v_hat) > MIN_SQNR[preset.value_bits]


@given(kv_tiles(group_size=128, head_dim=64, batch=1))
def test_error_within_half_a_step_in_the_normalized_frame(sample) -> None:
    k_rot = rotate(sample.k[0], axis=-1)
    b = variance_normalize(k_rot.T)
    col = round_log8(b.col_scale)  # the token factors as the record stores them
    balanced = k_rot.T / (b.row_scale[:, None] * col[None, :])
    q = quantize_rows(balanced, 4)
    records = encode_tiles(k_rot, rotate(sample.v[0], axis=-1), "kvarn_k4v2_g128")
    fields = read_fields(records, "kvarn_k4v2_g128", 64)
    np.testing.assert_array_equal(fields.k_codes, q.codes)
    np.testing.assert_array_equal(fields.k_token_scale, col)
    k_dec, _ = decode_tiles(records, "kvarn_k4v2_g128", 64)
    normalized = k_dec.T / (b.row_scale[:, None] * col[None, :])
    # fp16 storage of the folded scales adds ~2^-11 relative error on top of half a step
    bound = q.step[:, None] / 2 + 2e-3 * (np.abs(balanced) + np.abs(q.lo[:, None])) + 1e-6
    assert np.all(np.abs(normalized - balanced) <= bound)


@given(kv_tiles(group_size=128, head_dim=64, batch=1), st.sampled_from([0.1, 0.5, 2.0, 3.0, 30.0]))
def test_scaling_the_input_scales_the_output(sample, c: float) -> None:
    # Float rounding of c * x can flip a code at a rounding tie, the choice of best iteration
    # or a balancing factor across a log8 step: the records may then differ by a fraction of
    # the quantization error, and the scaled result is as accurate as the original.
    k, v = sample.k, sample.v
    base = dequantize_tiles(quantize_tiles(k, v, "kvarn_k4v4_g128"), "kvarn_k4v4_g128", 64)
    scaled = dequantize_tiles(
        quantize_tiles(c * k, c * v, "kvarn_k4v4_g128"), "kvarn_k4v4_g128", 64
    )
    for exact, a, b in zip((k, v), base, scaled):
        quant_error = relative_error(exact[0], a[0])
        assert relative_error(c * a, b) <= 0.5 * quant_error
        assert relative_error(c * exact[0], b[0]) <= 1.1 * quant_error


def test_deterministic_and_batched_equals_single() -> None:
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((2, 4, 128, 128)).astype(np.float32)
    one = quantize_tiles(k, v, "kvarn_k4v2_g128")
    np.testing.assert_array_equal(one, quantize_tiles(k, v, "kvarn_k4v2_g128"))
    for i in range(4):
        np.testing.assert_array_equal(one[i], quantize_tiles(k[i], v[i], "kvarn_k4v2_g128"))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("kind", ["zero", "constant", "outlier_1e4", "outlier_fp16_max"])
def test_adversarial_tiles_reconstruct_finite(preset: str, kind: str) -> None:
    p = get_preset(preset)
    rng = np.random.default_rng(4)
    k = np.zeros((p.group_size, 128), np.float32)
    v = np.zeros_like(k)
    if kind == "constant":
        k[:], v[:] = 2.5, -1.25
    elif kind.startswith("outlier"):
        k = rng.standard_normal(k.shape).astype(np.float32)
        v = rng.standard_normal(k.shape).astype(np.float32)
        big = 1e4 if kind == "outlier_1e4" else float(np.finfo(np.float16).max)
        k[7, 3] = big
        v[9, 100] = -big
    k_hat, v_hat = dequantize_tiles(quantize_tiles(k, v, p), p, 128)
    assert np.isfinite(k_hat).all() and np.isfinite(v_hat).all()
    if kind == "zero":
        np.testing.assert_array_equal(k_hat, k)
        np.testing.assert_array_equal(v_hat, v)
    elif kind == "constant":
        # the folded fp16 zero point cancels against code * scale only to fp16 rounding; at
        # 2 bits the residue on the 127 zero channels of the rotated row sums into one
        # original channel: up to ~5% there (measured 2.6% before log8 factors, 5.2% after)
        np.testing.assert_allclose(k_hat, k, rtol=0.08)
        np.testing.assert_allclose(v_hat, v, rtol=0.08)
    elif p.key_bits >= 4:
        assert abs(k_hat[7, 3] - k[7, 3]) < 0.05 * abs(k[7, 3])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_tile_and_position(bad: float) -> None:
    k = np.zeros((3, 128, 64), np.float32)
    v = np.zeros_like(k)
    v[2, 17, 5] = bad
    with pytest.raises(ValueError, match=r"v tile \(2,\) holds .* at token 17, channel 5"):
        quantize_tiles(k, v, "kvarn_k4v2_g128")


def test_shape_errors() -> None:
    k = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match="hold 128 tokens, got 64"):
        quantize_tiles(k, k, "kvarn_k4v2_g128")
    with pytest.raises(ValueError, match="one shape"):
        quantize_tiles(k, k[:32], "kvarn_k4v2_g64")
    with pytest.raises(ValueError, match="head_dim must be one of"):
        quantize_tiles(np.zeros((64, 32)), np.zeros((64, 32)), "kvarn_k4v2_g64")
    with pytest.raises(ValueError, match=r"records must be uint8 \[\.\.\., 3728\]"):
        decode_tiles(np.zeros((2, 100), np.uint8), "kvarn_k4v2_g64", 64)


def test_codes_unpack_consistently() -> None:
    k = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    rec = encode_tiles(k, k, "kvarn_k4v2_g64")
    f = read_fields(rec, "kvarn_k4v2_g64", 64)
    raw = rec[: 64 * 32].reshape(64, 32)
    np.testing.assert_array_equal(unpack(raw, 4, 64), f.k_codes)


def test_log8_codes_round_trip_and_cover_the_normalization_range() -> None:
    n = np.arange(256, dtype=np.uint8)
    factors = decode_log8(n)
    np.testing.assert_array_equal(encode_log8(factors), n)
    assert factors[16] == 1.0 and factors[0] == 0.5
    np.testing.assert_allclose(factors[1:] / factors[:-1], 2 ** (1 / 16), rtol=1e-6)
    # variance normalization returns exp(-0.3) .. exp(10): inside the code range, not clipped
    lo, hi = np.exp(np.float32(-0.3)), np.exp(np.float32(10.0))
    assert factors[0] < lo and hi < factors[255]
    x = np.float32(1.0) * np.exp(np.linspace(-0.3, 10.0, 1001, dtype=np.float32))
    assert np.all(np.abs(np.log2(round_log8(x) / x)) <= 1 / 32 + 1e-6)  # half a step
    assert encode_log8([1e-30, 1e30]).tolist() == [0, 255]  # saturates
    with pytest.raises(ValueError, match="positive and finite"):
        encode_log8([1.0, 0.0])
    with pytest.raises(ValueError, match="uint8"):
        decode_log8(np.array([1], np.int32))


def test_key_frame_errors_are_the_score_errors_of_both_frames() -> None:
    from kvarn_math.tile import key_frame_errors

    g, d = 128, 64
    k = make_kv((3, g, d), "outlier_channels", 11)  # [tiles, G, D]
    q = make_kv((3, 10, d), "gaussian", 12)  # 10 queries reading each tile
    rot, raw = key_frame_errors(k, q, "kvarn_k2v2_g128")
    assert rot.shape == raw.shape == (3,) and (rot > 0).all() and (raw > 0).all()
    # the rotated frame is the preset's own round trip; the raw one quantizes k's channels
    k_rot = dequantize_tiles(quantize_tiles(k, k, "kvarn_k2v2_g128"), "kvarn_k2v2_g128", d)[0]
    k_raw = decode_tiles(encode_tiles(k, k, "kvarn_k2v2_g128"), "kvarn_k2v2_g128", d)[0]
    for t in range(3):
        want_rot = ((q[t] @ (k_rot[t] - k[t]).T).astype(np.float64) ** 2).sum()
        want_raw = ((q[t] @ (k_raw[t] - k[t]).T).astype(np.float64) ** 2).sum()
        np.testing.assert_allclose([rot[t], raw[t]], [want_rot, want_raw], rtol=1e-5)
    # queries orthogonal to every key error see none: the criterion follows the queries
    zero = key_frame_errors(k, np.zeros_like(q), "kvarn_k2v2_g128")
    assert (zero[0] == 0).all() and (zero[1] == 0).all()


def test_key_frame_errors_reject_mismatched_shapes() -> None:
    from kvarn_math.tile import key_frame_errors

    k = make_kv((2, 64, 64), "gaussian", 1)
    with pytest.raises(ValueError, match="same leading dims"):
        key_frame_errors(k, k[:1], "kvarn_k4v2_g64")
    with pytest.raises(ValueError, match="q must be"):
        key_frame_errors(k, k[..., :32], "kvarn_k4v2_g64")


def test_raw_keys_are_flagged_and_decode_into_either_frame() -> None:
    g, d, p = 64, 64, "kvarn_k4v2_g64"
    k = make_kv((3, g, d), "outlier_channels", 21)
    v = make_kv((3, g, d), "gaussian", 22)
    raw = np.array([True, False, True])
    records = quantize_tiles(k, v, p, raw_keys=raw)
    fields = read_fields(records, p, d)
    np.testing.assert_array_equal(fields.raw_keys, raw)
    flags = records[..., -16:]
    np.testing.assert_array_equal(flags[:, 0], raw.astype(np.uint8))
    assert not flags[:, 1:].any()  # reserved bytes stay zero
    # a flagged tile is the plain encoding of its unrotated keys; values are unchanged
    k_plain, v_plain = decode_tiles(encode_tiles(k, rotate(v, axis=-1), p), p, d)
    k_hat, v_hat = dequantize_tiles(records, p, d)
    np.testing.assert_array_equal(k_hat[raw], k_plain[raw])
    unflagged = quantize_tiles(k, v, p)
    np.testing.assert_array_equal(records[1], unflagged[1])
    np.testing.assert_allclose(v_hat, dequantize_tiles(unflagged, p, d)[1])
    # decode_tiles gives every tile in the rotated frame
    k_rot, _ = decode_tiles(records, p, d)
    np.testing.assert_allclose(k_rot, rotate(k_hat, axis=-1), rtol=1e-5, atol=1e-4)
    # a scalar flag covers every tile
    assert read_fields(quantize_tiles(k, v, p, raw_keys=True), p, d).raw_keys.all()


def test_raw_keys_must_be_bool_per_tile() -> None:
    k = make_kv((2, 64, 64), "gaussian", 1)
    with pytest.raises(ValueError, match="raw_keys must be bool"):
        quantize_tiles(k, k, "kvarn_k4v2_g64", raw_keys=np.array([1, 0]))
    with pytest.raises(ValueError, match=r"one flag per tile \(2,\)"):
        quantize_tiles(k, k, "kvarn_k4v2_g64", raw_keys=np.array([True, False, True]))


def test_frame_query_rows_is_the_last_fresh_position() -> None:
    from kvarn_math.tile import FRAME_QUERY_ROWS, frame_query_rows

    assert FRAME_QUERY_ROWS == 1
    for n in (1, 5, 16, 17, 100, 128):
        np.testing.assert_array_equal(frame_query_rows(n), [n - 1])
    assert frame_query_rows(np.int64(7)).dtype == np.int64
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="num_rows must be an int >= 1"):
            frame_query_rows(bad)  # type: ignore[arg-type]


def test_choose_key_frames_follows_the_queries() -> None:
    from kvarn_math.tile import choose_key_frames, key_frame_errors, key_frame_estimates

    rng = np.random.default_rng(5)
    g, d, p = 128, 64, "kvarn_k2v2_g128"
    # channel scales over three decades (RoPE-like) read by queries that weigh the small ones:
    # rotating would spread the large channels' quantization error onto what the queries read
    scales = np.geomspace(0.01, 10, d).astype(np.float32)
    graded = (rng.standard_normal((g, d)) * scales).astype(np.float32)
    q_graded = (rng.standard_normal((8, d)) * scales[::-1]).astype(np.float32)
    # heavy-tailed channels of one scale: the rotation evens their outliers out
    heavy = rng.standard_t(2, (g, d)).astype(np.float32)
    q_heavy = rng.standard_normal((8, d)).astype(np.float32)
    k, q = np.stack([graded, heavy]), np.stack([q_graded, q_heavy])
    raw = choose_key_frames(k, q)
    np.testing.assert_array_equal(raw, [True, False])
    # the estimate picks the frame the exact score error prefers on both
    rot_err, raw_err = key_frame_errors(k, q, p)
    np.testing.assert_array_equal(raw, raw_err < rot_err)
    # it is sum_d (sum_i q_i[d]^2) (max_t k[t, d] - min_t k[t, d])^2 in each frame
    rot_est, raw_est = key_frame_estimates(k, q)
    spread = k.max(axis=1) - k.min(axis=1)
    want = ((q.astype(np.float64) ** 2).sum(axis=1) * spread.astype(np.float64) ** 2).sum(-1)
    np.testing.assert_allclose(raw_est, want, rtol=1e-5)
    k_rot, q_rot = rotate(k, axis=-1), rotate(q, axis=-1)
    spread = k_rot.max(axis=1) - k_rot.min(axis=1)
    want = ((q_rot.astype(np.float64) ** 2).sum(axis=1) * spread.astype(np.float64) ** 2).sum(-1)
    np.testing.assert_allclose(rot_est, want, rtol=1e-4)
    # queries that read nothing see no error in either frame
    zero = key_frame_estimates(k, np.zeros_like(q))
    assert (zero[0] == 0).all() and (zero[1] == 0).all()
    with pytest.raises(ValueError, match="same leading dims"):
        choose_key_frames(k, q[:1])
