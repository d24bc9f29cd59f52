import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.attention import dense_attention, dense_kv, quantize_sequence, reference_attention
from kvarn_math.hadamard import rotate
from kvarn_math.layout import get_preset
from kvarn_math.testing import kv_sequences, make_kv
from kvarn_math.tile import dequantize_tiles


def _naive(q, k, v, scale, window=None):
    tq, hq, d = q.shape
    t, hkv, _ = k.shape
    out = np.zeros((tq, hq, d))
    for i in range(tq):
        pos = t - tq + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(hq):
            kh = h // (hq // hkv)
            s = k[lo : pos + 1, kh] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[lo : pos + 1, kh]
    return out


@given(kv_sequences(max_tokens=200), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.booleans())
def test_dense_attention_matches_naive_loop(sample, tq, group, windowed) -> None:
    t, hkv, d = sample.k.shape
    tq = min(tq, t)
    q = make_kv((tq, hkv * group, d), "gaussian", sample.seed + 7)
    window = max(1, t // 3) if windowed else None
    got = dense_attention(q, sample.k, sample.v, scale=0.1, sliding_window=window)
    np.testing.assert_allclose(
        got, _naive(q, sample.k, sample.v, 0.1, window), rtol=1e-5, atol=1e-5
    )


@given(
    kv_sequences(max_tokens=300),
    st.booleans(),
    st.sampled_from(["kvarn_k4v4_g64", "kvarn_k4v2_g128"]),
)
def test_sequence_storage_splits_and_dense_kv_reassembles(sample, keep_first, preset) -> None:
    p = get_preset(preset)
    seq = quantize_sequence(sample.k, sample.v, p, keep_first_tile=keep_first)
    t, h, d = sample.k.shape
    g = p.group_size
    first = g if keep_first and t >= g else 0
    assert seq.num_tokens == t
    assert seq.records.shape[0] == (t - first) // g
    assert seq.tail_k.shape[0] < g
    k_rot, v_rot = dense_kv(seq)
    assert k_rot.shape == (t, h, d)
    # exact parts are the rotated inputs; the quantized body is what dequantize gives
    tail = seq.tail_k.shape[0]
    if tail:
        np.testing.assert_allclose(
            k_rot[t - tail :], rotate(sample.k[t - tail :], axis=-1), rtol=1e-5, atol=1e-5
        )
    if first:
        np.testing.assert_allclose(k_rot[:g], rotate(sample.k[:g], axis=-1), rtol=1e-5, atol=1e-5)
    if seq.records.shape[0]:
        k_body, _ = dequantize_tiles(seq.records[0], p, d)  # [H, G, D]
        np.testing.assert_allclose(
            rotate(k_body[0], axis=-1), k_rot[first : first + g, 0], rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("preset,max_err", [("kvarn_k4v4_g128", 0.2), ("kvarn_k4v2_g128", 0.6)])
def test_reference_attention_is_close_to_exact(preset: str, max_err: float) -> None:
    k = make_kv((700, 2, 128), "outlier_channels", 1)
    k /= k.std()
    v = make_kv((700, 2, 128), "gaussian", 2)
    q = make_kv((3, 8, 128), "gaussian", 3)
    seq = quantize_sequence(k, v, preset)
    exact = dense_attention(q, k, v)
    got = reference_attention(q, seq)
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 0 < err < max_err
    # an all-exact sequence (shorter than a tile) reproduces exact attention
    short = quantize_sequence(k[:100], v[:100], preset)
    np.testing.assert_allclose(
        reference_attention(q, short), dense_attention(q, k[:100], v[:100]), rtol=1e-4, atol=1e-5
    )


def test_attention_argument_errors() -> None:
    k = np.zeros((10, 2, 64), np.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        dense_attention(np.zeros((1, 3, 64)), k, k)
    with pytest.raises(ValueError, match="query tokens"):
        dense_attention(np.zeros((11, 2, 64)), k, k)
    with pytest.raises(ValueError, match="q tile .* holds nan"):
        dense_attention(np.full((1, 2, 64), np.nan), k, k)
    with pytest.raises(ValueError, match=r"\[T, H_kv, D\]"):
        quantize_sequence(np.zeros((10, 64)), np.zeros((10, 64)), "kvarn_k4v2_g64")
