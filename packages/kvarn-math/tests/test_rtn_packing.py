import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.packing import pack, packed_size, unpack
from kvarn_math.rtn import dequantize_rows, quantize_rows

bits_st = st.integers(1, 8)


@given(bits_st, st.integers(1, 40).map(lambda n: 8 * n), st.integers(0, 2**31))
def test_pack_unpack_is_identity(bits: int, length: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(3, length), dtype=np.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, packed_size(length, bits))
    np.testing.assert_array_equal(unpack(packed, bits, length), codes)


def test_packing_is_little_end_first() -> None:
    np.testing.assert_array_equal(
        pack(np.array([1, 2, 3, 4, 5, 6, 7, 8]) % 16, 4), [0x21, 0x43, 0x65, 0x87]
    )
    np.testing.assert_array_equal(pack(np.array([1, 2, 3, 0, 3, 3, 3, 3]), 2), [0b00111001, 0xFF])
    three = pack(np.arange(8), 3)  # 0 | 1<<3 | 2<<6 | 3<<9 | ... little-endian 24-bit word
    word = sum(i << (3 * i) for i in range(8))
    np.testing.assert_array_equal(three, [word & 0xFF, (word >> 8) & 0xFF, word >> 16])


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(np.zeros(12, np.uint8), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pack(np.full(8, 4), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(np.zeros(8), 9)
    with pytest.raises(ValueError, match="take 4 bytes"):
        unpack(np.zeros(5, np.uint8), 4, 8)


@given(bits_st, st.integers(0, 2**31), st.sampled_from([1e-3, 1.0, 1e3]))
def test_rtn_error_at_most_half_a_step(bits: int, seed: int, scale: float) -> None:
    x = (np.random.default_rng(seed).standard_normal((6, 64)) * scale).astype(np.float32)
    q = quantize_rows(x, bits)
    assert q.codes.max() < 2**bits
    err = np.abs(dequantize_rows(q) - x)
    assert np.all(err <= q.step[:, None] / 2 * (1 + 1e-4) + 1e-6 * np.abs(x).max())
    # the extremes are reproduced (up to float rounding)
    np.testing.assert_allclose(dequantize_rows(q).min(-1), x.min(-1), rtol=1e-5, atol=1e-6 * scale)


def test_rtn_constant_row() -> None:
    q = quantize_rows(np.full((2, 8), 7.0), 4)
    assert np.all(q.codes == 0) and np.all(q.step == 0)
    np.testing.assert_array_equal(dequantize_rows(q), np.full((2, 8), 7.0))


@given(st.integers(1, 4), st.integers(0, 2**31))
def test_clip_search_never_increases_row_error(bits: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_t(3, size=(8, 64)).astype(np.float32)
    plain = quantize_rows(x, bits)
    clipped = quantize_rows(x, bits, clip_ratios=(0.9, 0.8, 0.7))
    err_plain = ((dequantize_rows(plain) - x) ** 2).sum(-1)
    err_clip = ((dequantize_rows(clipped) - x) ** 2).sum(-1)
    assert np.all(err_clip <= err_plain * (1 + 1e-6))
    assert clipped.codes.max() < 2**bits
    with pytest.raises(ValueError, match="clip ratios"):
        quantize_rows(x, bits, clip_ratios=(1.5,))
