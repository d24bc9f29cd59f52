import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.attention import (
    dense_attention,
    dense_kv,
    quantize_sequence,
    recent_window_start,
    reference_attention,
    step_sequence,
)
from kvarn_math.hadamard import rotate, unrotate
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
    # the mean over four draws: one draw's error swings by +-40% (k4v4: 0.10-0.20 over seeds)
    errs = []
    for seed in range(1, 41, 10):
        k = make_kv((700, 2, 128), "outlier_channels", seed)
        k /= k.std()
        v = make_kv((700, 2, 128), "gaussian", seed + 1)
        q = make_kv((3, 8, 128), "gaussian", seed + 2)
        seq = quantize_sequence(k, v, preset)
        exact = dense_attention(q, k, v)
        got = reference_attention(q, seq)
        errs.append(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert 0 < np.mean(errs) < max_err
    # an all-exact sequence (shorter than a tile) reproduces exact attention
    short = quantize_sequence(k[:100], v[:100], preset)
    np.testing.assert_allclose(
        reference_attention(q, short), dense_attention(q, k[:100], v[:100]), rtol=1e-4, atol=1e-5
    )


def test_reference_attention_exact_kv_reads_the_queries_own_tokens_exact() -> None:
    # 300 tokens, the last 200 the chunk's own: positions [100, 256) sit in completed tiles
    # (records), [256, 300) in the tail; with exact_kv all of [100, 300) is attended exact.
    k = make_kv((300, 2, 64), "outlier_channels", 5)
    v = make_kv((300, 2, 64), "gaussian", 6)
    q = make_kv((200, 4, 64), "gaussian", 7)
    seq = quantize_sequence(k, v, "kvarn_k4v2_g128")
    k_rot, v_rot = dense_kv(seq)
    k_rot[100:] = rotate(k[100:], axis=-1)
    v_rot[100:] = rotate(v[100:], axis=-1)
    want = unrotate(dense_attention(rotate(q, axis=-1), k_rot, v_rot), axis=-1)
    got = reference_attention(q, seq, exact_kv=(k[100:], v[100:]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # and it differs from reading the completed tiles as stored
    assert np.abs(reference_attention(q, seq) - got).max() > 1e-3
    with pytest.raises(ValueError, match="exact_kv must be two"):
        reference_attention(q, seq, exact_kv=(k[:10], v[:10]))


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


def _assert_same_sequence(a, b) -> None:
    assert a.preset == b.preset and a.head_dim == b.head_dim
    for name in ("records", "tail_k", "tail_v", "first_k", "first_v"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), name


@pytest.mark.parametrize("t", [50, 128, 300])
@pytest.mark.parametrize("requantize", [False, True])
def test_sink_tokens_at_the_ends_equal_the_old_options(t: int, requantize: bool) -> None:
    k = make_kv((t, 2, 64), "outlier_channels", 4)
    v = make_kv((t, 2, 64), "gaussian", 5)
    preset = "kvarn_k4v2_g128"
    full = quantize_sequence(k, v, preset, sink_tokens=128, sink_requantize=requantize)
    _assert_same_sequence(full, quantize_sequence(k, v, preset, keep_first_tile=True))
    none = quantize_sequence(k, v, preset, sink_tokens=0, sink_requantize=requantize)
    _assert_same_sequence(none, quantize_sequence(k, v, preset))
    assert none.sink_tokens == 0 and full.sink_tokens == (128 if t >= 128 else 0)


@pytest.mark.parametrize("requantize", [False, True])
@pytest.mark.parametrize("sink", [1, 16, 127])
def test_partial_sink_overlays_tile_zero(sink: int, requantize: bool) -> None:
    k = make_kv((300, 2, 64), "outlier_channels", 6)
    v = make_kv((300, 2, 64), "gaussian", 7)
    p = get_preset("kvarn_k4v4_g64")
    g = p.group_size
    sink = min(sink, g - 1)
    seq = quantize_sequence(k, v, p, sink_tokens=sink, sink_requantize=requantize)
    assert seq.num_tokens == 300 and seq.sink_tokens == sink
    assert seq.records.shape[0] == 300 // g  # tile 0 keeps its record
    k_rot, v_rot = dense_kv(seq)
    # positions < S read exact; the rest of tile 0 and later tiles read the records
    np.testing.assert_allclose(k_rot[:sink], rotate(k[:sink], axis=-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_rot[:sink], rotate(v[:sink], axis=-1), rtol=1e-5, atol=1e-5)
    plain_k, plain_v = dense_kv(quantize_sequence(k, v, p))
    if requantize:
        assert np.array_equal(k_rot[g:], plain_k[g:]) and np.array_equal(v_rot[g:], plain_v[g:])
    else:
        assert np.array_equal(k_rot[sink:], plain_k[sink:])
        assert np.array_equal(v_rot[sink:], plain_v[sink:])


@pytest.mark.parametrize("sink", [1, 4, 64])
def test_requantized_tile_zero_ignores_the_sink_tokens(sink: int) -> None:
    k = make_kv((256, 2, 64), "gaussian", 8)
    v = make_kv((256, 2, 64), "gaussian", 9)
    k2, v2 = k.copy(), v.copy()
    k2[:sink] = 1000.0 * make_kv((sink, 2, 64), "gaussian", 10)
    v2[:sink] = -50.0
    preset = "kvarn_k4v2_g128"
    a = quantize_sequence(k, v, preset, sink_tokens=sink, sink_requantize=True)
    b = quantize_sequence(k2, v2, preset, sink_tokens=sink, sink_requantize=True)
    assert np.array_equal(a.records, b.records)
    # without requantizing, the outlier sink changes tile 0's record (and only it)
    c = quantize_sequence(k2, v2, preset, sink_tokens=sink)
    assert not np.array_equal(c.records[0], b.records[0])
    assert np.array_equal(c.records[1:], b.records[1:])


def test_sink_argument_errors() -> None:
    k = np.zeros((256, 2, 64), np.float32)
    for bad in (-1, 129):
        with pytest.raises(ValueError, match="sink_tokens must be in"):
            quantize_sequence(k, k, "kvarn_k4v2_g128", sink_tokens=bad)
    with pytest.raises(ValueError, match="not both"):
        quantize_sequence(k, k, "kvarn_k4v2_g128", keep_first_tile=True, sink_tokens=4)


@given(
    kv_sequences(max_tokens=400),
    st.booleans(),
    st.integers(0, 3),
    st.sampled_from(["kvarn_k4v4_g64", "kvarn_k4v2_g128"]),
)
def test_recent_tiles_read_exact_rows_and_leave_records(sample, keep_first, recent, preset) -> None:
    p = get_preset(preset)
    g = p.group_size
    plain = quantize_sequence(sample.k, sample.v, p, keep_first_tile=keep_first)
    seq = quantize_sequence(sample.k, sample.v, p, keep_first_tile=keep_first, recent_tiles=recent)
    np.testing.assert_array_equal(seq.records, plain.records)
    assert seq.num_tokens == plain.num_tokens
    n = plain.records.shape[0]
    assert seq.recent_tiles == min(recent, n)
    t = sample.k.shape[0]
    end = t - plain.tail_k.shape[0]
    lo = end - seq.recent_tiles * g
    k_rot, v_rot = dense_kv(seq)
    k_plain, v_plain = dense_kv(plain)
    np.testing.assert_allclose(k_rot[lo:end], rotate(sample.k[lo:end], axis=-1), atol=1e-5)
    np.testing.assert_allclose(v_rot[lo:end], rotate(sample.v[lo:end], axis=-1), atol=1e-5)
    # everything else reads what it read without the window
    np.testing.assert_array_equal(k_rot[:lo], k_plain[:lo])
    np.testing.assert_array_equal(v_rot[end:], v_plain[end:])


def test_recent_tiles_rejects_negative() -> None:
    k = make_kv((300, 1, 64), "gaussian", 1)
    with pytest.raises(ValueError, match="recent_tiles must be an int >= 0, got -1"):
        quantize_sequence(k, k, "kvarn_k4v2_g128", recent_tiles=-1)


@pytest.mark.parametrize(
    ("cached", "seq_len", "quantized", "recent", "ring", "start", "want"),
    [
        (300, 301, 256, 1, 2, 0, 128),  # decode inside tile 2: tile 1 is the window
        (383, 384, 384, 1, 2, 0, 128),  # decode completing tile 2: still tile 1
        (383, 384, 384, 0, 1, 0, 384),  # no window: every complete tile from its record
        (256, 384, 384, 1, 2, 0, 128),  # tile-aligned chunk: the tile before it
        (256, 384, 384, 2, 3, 0, 0),  # two tiles before it
        (256, 384, 384, 2, 3, 128, 128),  # a prefix-cache hit: tile 0 exists only as a record
        (100, 612, 512, 1, 2, 0, 384),  # a long chunk: the ring holds [356, 612) -> from 384
        (10, 20, 0, 1, 2, 0, 0),  # nothing quantized yet
    ],
)
def test_recent_window_counts_from_the_steps_first_token(
    cached: int, seq_len: int, quantized: int, recent: int, ring: int, start: int, want: int
) -> None:
    got = recent_window_start(cached, seq_len, quantized, 128, recent, ring, start)
    assert got == want


@given(st.integers(0, 2000), st.integers(1, 300), st.integers(0, 3), st.integers(1, 2))
def test_recent_window_fits_the_ring(cached: int, new: int, recent: int, open_tiles: int) -> None:
    g = 64
    seq_len = cached + new
    quantized = seq_len // g * g
    ring = open_tiles + recent
    read = recent_window_start(cached, seq_len, quantized, g, recent, ring)
    assert read % g == 0 and read <= quantized
    assert seq_len - read <= ring * g  # what it reads exact fits staging
    if recent and seq_len <= (cached // g + open_tiles) * g:
        # a step within its open tiles keeps the whole window (longer ones read their own)
        assert read == min(quantized, max(0, (cached // g - recent) * g))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 5, 0, 64, 1, 2), "num_cached \\(10\\) <= seq_len \\(5\\)"),
        ((10, 20, 7, 64, 1, 2), "quantized_len \\(7\\) and exact_start \\(0\\) must be multiples"),
        ((10, 20, 0, 64, -1, 2), "recent_tiles must be an int >= 0, got -1"),
        ((10, 20, 0, 64, 1, 0), "ring_tiles must be an int >= 1, got 0"),
    ],
)
def test_recent_window_rejects_bad_lengths(args: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        recent_window_start(*args)


def test_step_sequence_keeps_the_window_before_a_completed_tile() -> None:
    """A decode step completing tile 2 reads tiles 1 and 2 exact, tile 0 as a record."""
    g = 64
    k = make_kv((3 * g, 2, 64), "outlier_channels", 3)
    v = make_kv((3 * g, 2, 64), "gaussian", 4)
    seq = step_sequence(k, v, "kvarn_k4v2_g64", 3 * g - 1, recent_tiles=1, ring_tiles=2)
    assert seq.recent_tiles == 2  # its own tile (open when the step began) and the one before
    k_rot, _ = dense_kv(seq)
    plain, _ = dense_kv(quantize_sequence(k, v, "kvarn_k4v2_g64"))
    np.testing.assert_allclose(k_rot[g:], rotate(k[g:], axis=-1), atol=1e-5)
    np.testing.assert_array_equal(k_rot[:g], plain[:g])
    # the sink tile is exact anyway: no record of it to count
    sunk = step_sequence(
        k[: 2 * g],
        v[: 2 * g],
        "kvarn_k4v2_g64",
        g + 3,
        recent_tiles=2,
        ring_tiles=3,
        keep_first_tile=True,
    )
    assert sunk.recent_tiles == 1


@given(
    kv_sequences(max_tokens=400),
    st.sampled_from([0, 3, 64]),
    st.integers(0, 2),
    st.sampled_from(["kvarn_k4v2_g64", "kvarn_k4v4_g64"]),
)
def test_value_windows_read_keys_from_records(sample, sink, recent, preset) -> None:
    """window_keys=False: the sink and recent tiles give their values exact and their keys as
    their records hold them; everything else reads as with both exact."""
    p = get_preset(preset)
    seq = quantize_sequence(
        sample.k, sample.v, p, sink_tokens=sink, recent_tiles=recent, window_keys=False
    )
    both = quantize_sequence(sample.k, sample.v, p, sink_tokens=sink, recent_tiles=recent)
    bare = quantize_sequence(sample.k, sample.v, p)  # no exact window: every tile a record
    t = sample.k.shape[0]
    assert seq.num_tokens == t and seq.first_record == 0
    assert seq.first_k is None and seq.recent_k is None
    assert seq.sink_tokens == both.sink_tokens and seq.recent_tiles == both.recent_tiles
    np.testing.assert_array_equal(seq.records, bare.records)  # tile 0 has its record
    k_rot, v_rot = dense_kv(seq)
    np.testing.assert_array_equal(k_rot, dense_kv(bare)[0])
    np.testing.assert_array_equal(v_rot, dense_kv(both)[1])


def test_value_windows_halve_what_is_exact() -> None:
    g = 64
    k = make_kv((4 * g + 5, 2, 64), "outlier_channels", 5)
    v = make_kv((4 * g + 5, 2, 64), "gaussian", 6)
    seq = step_sequence(
        k,
        v,
        "kvarn_k4v2_g64",
        4 * g + 4,
        recent_tiles=1,
        ring_tiles=2,
        keep_first_tile=True,
        window_keys=False,
    )
    assert seq.sink_tokens == g and seq.recent_tiles == 1 and seq.records.shape[0] == 4
    k_rot, v_rot = dense_kv(seq)
    exact_v = rotate(v, axis=-1)
    np.testing.assert_allclose(v_rot[:g], exact_v[:g], atol=1e-5)  # sink values
    np.testing.assert_allclose(v_rot[3 * g :], exact_v[3 * g :], atol=1e-5)  # recent + open
    assert np.abs(v_rot[g : 3 * g] - exact_v[g : 3 * g]).max() > 1e-3  # records in between
    recs = dense_kv(quantize_sequence(k, v, "kvarn_k4v2_g64"))[0]
    np.testing.assert_array_equal(k_rot[: 4 * g], recs[: 4 * g])  # every complete key a record
    np.testing.assert_allclose(k_rot[4 * g :], rotate(k, axis=-1)[4 * g :], atol=1e-5)


@pytest.mark.parametrize(
    ("cached", "seq_len", "quantized", "open_tiles", "start", "want"),
    [
        (300, 301, 256, 1, 0, 256),  # decode inside tile 2: its own tile
        (383, 384, 384, 1, 0, 256),  # decode completing tile 2: still its own tile
        (256, 384, 384, 1, 0, 256),  # tile-aligned chunk: its own tile
        (100, 612, 512, 1, 0, 512),  # a long chunk: the key ring holds [484, 612) -> from 512
        (384, 400, 384, 1, 384, 384),  # a prefix-cache hit of 3 tiles: records only
    ],
)
def test_key_window_is_the_steps_own_tile(cached, seq_len, quantized, open_tiles, start, want):
    from kvarn_math.attention import key_window_start

    assert key_window_start(cached, seq_len, quantized, 128, open_tiles, start) == want


def test_step_sequence_value_windows_keep_the_own_tiles_keys() -> None:
    """A decode step completing tile 2 with values-only windows: tile 2's keys and values
    exact (its own tile), tile 1's values exact and keys from its record, tile 0's values
    exact (sink) and keys from its record."""
    g = 64
    k = make_kv((3 * g, 2, 64), "outlier_channels", 8)
    v = make_kv((3 * g, 2, 64), "gaussian", 9)
    seq = step_sequence(
        k,
        v,
        "kvarn_k4v2_g64",
        3 * g - 1,
        recent_tiles=1,
        ring_tiles=2,
        keep_first_tile=True,
        window_keys=False,
    )
    assert seq.records.shape[0] == 3 and seq.recent_tiles == 2 and seq.sink_tokens == g
    assert seq.recent_k is not None and seq.recent_k.shape[0] == g
    k_rot, v_rot = dense_kv(seq)
    recs_k, recs_v = dense_kv(quantize_sequence(k, v, "kvarn_k4v2_g64"))
    np.testing.assert_allclose(v_rot, rotate(v, axis=-1), atol=1e-5)  # every value exact
    np.testing.assert_array_equal(k_rot[: 2 * g], recs_k[: 2 * g])  # tiles 0, 1: records
    np.testing.assert_allclose(k_rot[2 * g :], rotate(k, axis=-1)[2 * g :], atol=1e-5)
    with pytest.raises(ValueError, match="recent_key_tiles must be an int >= 0"):
        quantize_sequence(
            k, v, "kvarn_k4v2_g64", recent_tiles=1, window_keys=False, recent_key_tiles=-1
        )


def test_step_sequence_value_windows_completing_tile_zero_reads_its_keys_exact() -> None:
    g = 64
    k = make_kv((g, 1, 64), "outlier_channels", 11)
    v = make_kv((g, 1, 64), "gaussian", 12)
    seq = step_sequence(
        k,
        v,
        "kvarn_k4v2_g64",
        g - 1,
        recent_tiles=1,
        ring_tiles=2,
        keep_first_tile=True,
        window_keys=False,
    )
    k_rot, v_rot = dense_kv(seq)
    np.testing.assert_allclose(k_rot, rotate(k, axis=-1), atol=1e-5)
    np.testing.assert_allclose(v_rot, rotate(v, axis=-1), atol=1e-5)
