import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.hadamard import fwht, hadamard_matrix, random_signs, rotate, unrotate

powers = st.sampled_from([1, 2, 4, 8, 16, 64, 128, 256, 512])


@given(powers)
def test_matrix_is_orthonormal_and_symmetric(size: int) -> None:
    h = hadamard_matrix(size)
    np.testing.assert_allclose(h @ h.T, np.eye(size), atol=1e-12)
    np.testing.assert_array_equal(h, h.T)


@given(powers, st.integers(0, 2**31), st.integers(0, 2))
def test_fwht_equals_matrix_product_on_any_axis(size: int, seed: int, axis: int) -> None:
    rng = np.random.default_rng(seed)
    shape = [3, 5, 2]
    shape[axis] = size
    x = rng.standard_normal(shape)
    expected = np.moveaxis(np.moveaxis(x, axis, -1) @ hadamard_matrix(size), -1, axis)
    np.testing.assert_allclose(fwht(x, axis=axis), expected, rtol=1e-10, atol=1e-10)


@given(powers, st.integers(0, 2**31))
def test_fwht_is_self_inverse_and_keeps_float32(size: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((4, size)).astype(np.float32)
    y = fwht(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(fwht(y), x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@given(st.sampled_from([8, 64, 128]), st.integers(0, 2**31), st.integers(0, 2**31))
def test_random_sign_rotation_inverts_and_preserves_dot_products(
    size: int, seed: int, data_seed: int
) -> None:
    signs = random_signs(size, seed)
    np.testing.assert_array_equal(signs, random_signs(size, seed))
    assert set(np.unique(signs)) <= {-1.0, 1.0}
    rng = np.random.default_rng(data_seed)
    q, k = rng.standard_normal((2, 7, size))
    np.testing.assert_allclose(unrotate(rotate(k, signs=signs), signs=signs), k, atol=1e-10)
    np.testing.assert_allclose(
        rotate(q, signs=signs) @ rotate(k, signs=signs).T, q @ k.T, rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("bad", [0, 3, 96, -4])
def test_non_power_of_two_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(bad)
    if bad > 0:
        with pytest.raises(ValueError, match="power of two"):
            fwht(np.ones((2, bad)))
