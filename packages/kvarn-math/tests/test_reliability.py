"""No input gives silent garbage: large magnitudes, corrupt records, NaN, awkward shapes."""

from __future__ import annotations

import numpy as np
import pytest
from kvarn_math import (
    dequantize_rows,
    dequantize_tiles,
    get_preset,
    quantize_rows,
    quantize_tiles,
    read_fields,
    tile_layout,
    variance_normalize,
)
from kvarn_math.baselines import standard_methods
from kvarn_math.metrics import relative_error
from kvarn_math.ranges import INPUT_BOUND, check_records, float_exponent, pow2
from kvarn_math.testing import make_kv

BF16_MAX = 3.3895313892515355e38
MAGNITUDES = [1e4, 1e5, 1e8, 1e20, BF16_MAX]
HELD = [1e4, 1e5, 1e8]  # held within the format's error; past ~5e8 it depends on the tile


def _tiles(preset: str, d: int, magnitude: float, shape: str) -> np.ndarray:
    """Two tiles ``[2, G, D]``: the whole tile at ``magnitude`` (largest |x|), or an ordinary
    tile with one element at ``magnitude``."""
    g = get_preset(preset).group_size
    x = make_kv((2, g, d), "outlier_channels", 5)
    x = x / np.abs(x).max(axis=(-2, -1), keepdims=True)
    if shape == "whole":
        return (x.astype(np.float64) * magnitude).astype(np.float32)
    x[:, 7, 3] = magnitude
    x[1, 70 % g, 9] = -magnitude
    return x


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g64"])
@pytest.mark.parametrize("shape", ["whole", "outlier"])
@pytest.mark.parametrize("magnitude", HELD)
def test_large_tiles_come_back_within_the_formats_error(
    preset: str, shape: str, magnitude: float
) -> None:
    d = 64
    x = _tiles(preset, d, magnitude, shape)
    unit = _tiles(preset, d, 1.0, "whole")
    k, v = dequantize_tiles(quantize_tiles(x, x, preset), preset, d)
    assert np.isfinite(k).all() and np.isfinite(v).all()
    if shape == "whole":
        # the same tile at magnitude 1 gives the format's error; scaled, it must give the same
        k1, v1 = dequantize_tiles(quantize_tiles(unit, unit, preset), preset, d)
        for got, ref in ((k, k1), (v, v1)):
            assert relative_error(x, got) <= 1.01 * relative_error(unit, ref) + 1e-6
    else:
        # the outlier itself comes back within its row's rounding step, the tile within the
        # error of its bits (before 2026-12-06: 0.71 and 0.99 at 1e8, NaN at 1e20)
        p = get_preset(preset)
        for got, bits in ((k, p.key_bits), (v, p.value_bits)):
            assert abs(got[0, 7, 3] / magnitude - 1) < 0.05
            assert relative_error(x, got) < (0.05 if bits >= 4 else 0.2)


def test_powers_of_two_scale_records_exactly() -> None:
    """Scaling a tile by 2^e changes only the exponent: the records decode to exactly 2^e
    times the unscaled tile's, for every e that fits (records of e = 0 are the format's
    before the range fitting existed: their row scales fit fp16)."""
    preset, d = "kvarn_k4v2_g64", 64
    x = make_kv((1, 64, d), "heavy_tailed", 2)
    x = x / np.abs(x).max()
    k0, v0 = dequantize_tiles(quantize_tiles(x, x, preset), preset, d)
    for e in (0, 10, 16, 20, 28):
        s = np.float32(2.0**e)
        k, v = dequantize_tiles(quantize_tiles(x * s, x * s, preset), preset, d)
        np.testing.assert_array_equal(k, k0 * s)
        np.testing.assert_array_equal(v, v0 * s)


@pytest.mark.parametrize("shape", ["whole", "outlier"])
@pytest.mark.parametrize("magnitude", [1e20, BF16_MAX])
def test_tiles_no_record_holds_raise_or_saturate(shape: str, magnitude: float) -> None:
    preset, d = "kvarn_k4v2_g64", 64
    x = _tiles(preset, d, magnitude, shape)
    with pytest.raises(ValueError, match=r"k tile \(0,\).*past what a KVarN record holds"):
        quantize_tiles(x, x, preset)
    rec = quantize_tiles(x, x, preset, overflow="saturate")
    check_records(rec, preset, d)
    k, v = dequantize_tiles(rec, preset, d)
    assert np.isfinite(k).all() and np.isfinite(v).all()
    # saturated, not garbage: the largest reconstructed magnitude is a large one
    assert np.abs(k).max() > 1e8 and np.abs(v).max() > 1e8


def test_overflow_argument_is_checked() -> None:
    x = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match="overflow must be one of"):
        quantize_tiles(x, x, "kvarn_k4v2_g64", overflow="clip")


def test_exponent_helpers() -> None:
    x = np.array([1.0, 1.5, 2.0**-126, 3e38, 0.0], np.float32)
    np.testing.assert_array_equal(float_exponent(x), [0, 0, -126, 127, -127])
    np.testing.assert_array_equal(pow2(np.array([-126, 0, 127])), [2.0**-126, 1.0, 2.0**127])
    with pytest.raises(ValueError, match="pow2 takes exponents"):
        pow2(np.array([128]))
    assert INPUT_BOUND == 2.0**100


def test_random_bytes_are_rejected_naming_record_and_field() -> None:
    preset, d = "kvarn_k4v2_g128", 128
    lay = tile_layout(preset, d)
    rng = np.random.default_rng(0)
    for seed in range(20):
        rec = np.random.default_rng(seed).integers(0, 256, (3, lay.tile_bytes), dtype=np.uint8)
        with pytest.raises(ValueError, match=r"record \(\d,\) is not a valid kvarn_k4v2_g128"):
            dequantize_tiles(rec, preset, d)
    good = quantize_tiles(
        rng.standard_normal((2, 128, d)), rng.standard_normal((2, 128, d)), preset
    )
    check_records(good, preset, d)
    for field, value, message in (
        ("k_scale", np.float16(np.inf), r"record \(1,\).*k_scale\[5\] holds inf"),
        ("v_scale", np.float16(-1.0), r"record \(1,\).*v_scale\[5\] holds -1.0.*>= 0"),
        ("k_zero", np.float16(np.nan), r"record \(1,\).*k_zero\[5\] holds nan"),
    ):
        bad = good.copy()
        f = lay.field(field)
        bad[1, f.offset + 10 : f.offset + 12] = np.array([value]).view(np.uint8)
        with pytest.raises(ValueError, match=message):
            dequantize_tiles(bad, preset, d)
    bad = good.copy()
    bad[0, lay.field("flags").offset + 3] = 1
    with pytest.raises(ValueError, match=r"record \(0,\).*flags byte 3 is 1"):
        dequantize_tiles(bad, preset, d)
    assert read_fields(bad, preset, d).k_scale.shape == (2, d)  # reading fields does not check


def _with_nan(shape: tuple[int, ...], index: tuple[int, ...], value: float) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x[index] = value
    return x


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_baselines_reject_non_finite_input(value: float) -> None:
    k = _with_nan((128, 2, 64), (3, 1, 4), value)
    v = _with_nan((128, 2, 64), (5, 0, 2), value)
    for method in standard_methods():
        with pytest.raises(ValueError, match=r"k holds .* at token 3, head 1, channel 4"):
            method.roundtrip(k, np.zeros_like(v))
        with pytest.raises(ValueError, match=r"v holds .* at token 5, head 0, channel 2"):
            method.roundtrip(np.zeros_like(k), v)


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_rows_and_normalization_reject_non_finite_input(value: float) -> None:
    x = _with_nan((3, 8, 8), (2, 1, 6), value)
    with pytest.raises(ValueError, match=r"x holds .* at \(2, 1, 6\); rows must be finite"):
        quantize_rows(x, 4)
    with pytest.raises(ValueError, match=r"tile holds .* at \(2, 1, 6\); .* must be finite"):
        variance_normalize(x)


def test_rows_need_a_column() -> None:
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., R, C\] with C >= 1"):
        quantize_rows(np.zeros((4, 0)), 4)
    q = quantize_rows(np.zeros((0, 5)), 4)
    assert dequantize_rows(q).shape == (0, 5)


def test_variance_normalization_of_huge_tiles_is_finite() -> None:
    x = make_kv((8, 16), "gaussian", 3) * np.float32(1e30)
    b = variance_normalize(x)
    assert np.isfinite(b.row_scale).all() and np.isfinite(b.tile).all()
    np.testing.assert_allclose(b.tile * b.row_scale[:, None] * b.col_scale[None, :], x, rtol=1e-5)


@pytest.mark.parametrize("d", [96, 80, 0])
def test_unsupported_head_dims_get_the_clear_error(d: int) -> None:
    x = np.zeros((2, 128, d), np.float32)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 256, 512\).*got"):
        quantize_tiles(x, x, "kvarn_k4v2_g128")
    kv = np.zeros((128, 2, d), np.float32)
    for method in standard_methods():
        if method.name.startswith(("kvarn", "hadamard")):
            with pytest.raises(ValueError, match=rf"head_dim must be .*got {d}"):
                method.roundtrip(kv, kv)
        elif d:
            assert method.roundtrip(kv, kv)[0].shape == kv.shape


def test_empty_inputs() -> None:
    preset = "kvarn_k4v2_g128"
    x = np.zeros((0, 128, 64), np.float32)
    rec = quantize_tiles(x, x, preset)
    assert rec.shape == (0, tile_layout(preset, 64).tile_bytes)
    k, v = dequantize_tiles(rec, preset, 64)
    assert k.shape == v.shape == (0, 128, 64)
    kv = np.zeros((0, 2, 64), np.float32)
    for method in standard_methods():
        k, v = method.roundtrip(kv, kv)
        assert k.shape == v.shape == kv.shape
