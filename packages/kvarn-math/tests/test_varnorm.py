import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.testing import kv_tiles
from kvarn_math.varnorm import LOG_SCALE_CLIP, imbalance, tile_rms, variance_normalize


@given(kv_tiles(group_size=64, head_dim=st.sampled_from([64, 128])), st.integers(0, 12))
def test_never_worse_than_input_and_reconstructs(sample, iterations: int) -> None:
    x = sample.k
    b = variance_normalize(x, iterations)
    assert np.all(b.imbalance <= imbalance(x) * (1 + 1e-6))
    np.testing.assert_allclose(b.imbalance, imbalance(b.tile), rtol=1e-4)
    rebuilt = b.tile * b.row_scale[..., :, None] * b.col_scale[..., None, :]
    np.testing.assert_allclose(rebuilt, x, rtol=1e-5, atol=1e-6 * np.abs(x).max())
    lo, hi = np.exp(LOG_SCALE_CLIP[0]), np.exp(LOG_SCALE_CLIP[1])
    for s in (b.row_scale / tile_rms(x)[..., None], b.col_scale):
        assert np.all(s >= lo * (1 - 1e-6)) and np.all(s <= hi * (1 + 1e-6))


def test_balances_an_outlier_channel_tile() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    x[5] *= 50
    x[:, 3] *= 30
    b = variance_normalize(x)
    assert b.imbalance < imbalance(x) / 5


def test_zero_iterations_is_identity() -> None:
    x = np.random.default_rng(1).standard_normal((2, 16, 8)).astype(np.float32)
    b = variance_normalize(x, 0)
    rms = tile_rms(x)
    np.testing.assert_allclose(b.tile, x / rms[:, None, None], rtol=1e-6)
    np.testing.assert_array_equal(b.row_scale, np.repeat(rms[:, None], 16, axis=1))
    np.testing.assert_array_equal(b.col_scale, np.ones((2, 8), np.float32))


def test_scale_equivariance_of_the_balanced_tile() -> None:
    x = np.random.default_rng(6).standard_normal((64, 32)).astype(np.float32)
    x[:, 2] *= 0.01  # a column small enough that the -0.3 log-scale floor would bind
    a, b = variance_normalize(x), variance_normalize(x * 0.125)
    np.testing.assert_allclose(a.tile, b.tile, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.row_scale * 0.125, b.row_scale, rtol=1e-5)


def test_batched_equals_one_by_one() -> None:
    x = np.random.default_rng(2).standard_normal((3, 32, 16)).astype(np.float32) * [
        [[1.0]],
        [[10.0]],
        [[0.01]],
    ]
    whole = variance_normalize(x)
    for i in range(3):
        one = variance_normalize(x[i])
        np.testing.assert_array_equal(whole.tile[i], one.tile)
        np.testing.assert_array_equal(whole.col_scale[i], one.col_scale)


@pytest.mark.parametrize("kind", ["zero", "constant"])
def test_degenerate_tiles_stay_finite(kind: str) -> None:
    x = np.zeros((64, 64), np.float32) if kind == "zero" else np.full((64, 64), 3.5, np.float32)
    b = variance_normalize(x)
    assert (
        np.isfinite(b.tile).all()
        and np.isfinite(b.row_scale).all()
        and np.isfinite(b.col_scale).all()
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="iterations"):
        variance_normalize(np.ones((4, 4)), -1)
    with pytest.raises(ValueError, match="R, C >= 2"):
        variance_normalize(np.ones(4))
