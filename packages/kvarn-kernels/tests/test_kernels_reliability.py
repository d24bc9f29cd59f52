"""Values past fp16's range: the store kernel writes the reference's bytes, saturates and
counts what no record holds; decode and attention read such records as the reference does."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import as_dtype, build_paged, nan_like_staging, unwritten_cache
from kvarn_math import (
    decode_tiles,
    encode_tiles,
    quantize_tiles,
    read_fields,
    reference_attention,
    rotate,
    tile_layout,
)
from kvarn_math.ranges import INPUT_BOUND
from kvarn_math.testing import assert_close_rms, code_agreement, make_kv

PRESET, D, G = "kvarn_k4v2_g64", 64, 64
BF16_MAX = 3.3895313892515355e38
MAGNITUDES = [1e4, 1e5, 1e8, 1e20, BF16_MAX]
HELD = 3  # the first three are held within the format's error; the others saturate


def _tiles() -> np.ndarray:
    """``[10, G, D]``: per magnitude a whole tile at it and an ordinary tile with one outlier
    element at it (float32: the bf16 maximum rounds to a finite float32)."""
    x = make_kv((len(MAGNITUDES), G, D), "outlier_channels", 3)
    x = x / np.abs(x).max(axis=(-2, -1), keepdims=True)
    out = []
    for i, m in enumerate(MAGNITUDES):
        out.append((x[i].astype(np.float64) * m).astype(np.float32))
        single = x[(i + 1) % len(MAGNITUDES)].copy()
        single[5, 9] = m
        out.append(single)
    return np.stack(out)


def _reference(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """What the kernel must store: the saturating reference on the rotated tokens as rounded
    to the model dtype (the store's staging)."""
    rot = as_dtype(rotate(np.clip(x, -INPUT_BOUND, INPUT_BOUND), axis=-1), dtype)
    return encode_tiles(rot, rot[::-1].copy(), PRESET, overflow="saturate")


def _check_store(device: str, dtype: torch.dtype) -> None:
    x = _tiles()
    t = torch.from_numpy(x).to(dtype).to(device)
    got = kk.quantize_tiles(t, t.flip(0), PRESET, overflow="saturate").cpu().numpy()
    want = _reference(t.float().cpu().numpy(), dtype)
    # fp32 tiles that fit: byte for byte. Rotated tokens rounded to bf16, and the tiles
    # clipped to +-2^100 (whose rotated values tie), may round a few codes differently: the
    # transforms' summation orders differ (as test_kernels_store allows)
    if dtype == torch.float32:
        np.testing.assert_array_equal(got[:-2], want[:-2])
    fg, fw = read_fields(got, PRESET, D), read_fields(want, PRESET, D)
    for name in ("k_scale", "k_zero", "k_token_scale", "v_channel_scale", "v_scale", "v_zero"):
        np.testing.assert_allclose(
            getattr(fg, name).astype(np.float64), getattr(fw, name), rtol=2e-3, err_msg=name
        )
    assert code_agreement(fw.k_codes, fg.k_codes) >= 0.995
    assert code_agreement(fw.v_codes, fg.v_codes) >= 0.995
    # the GPU decoder reads them as the reference does, finite everywhere
    k_got, v_got = kk.decode_tiles(torch.from_numpy(got).to(device), PRESET, D)
    k_want, v_want = decode_tiles(got, PRESET, D)
    np.testing.assert_allclose(k_got.cpu().numpy(), k_want, rtol=1e-6)
    np.testing.assert_allclose(v_got.cpu().numpy(), v_want, rtol=1e-6)
    assert np.isfinite(k_want).all() and np.isfinite(v_want).all()
    # strict mode: both raise for the saturated tiles only
    held = t[: 2 * HELD].contiguous()
    kk.quantize_tiles(held, held, PRESET)
    for i in range(2 * HELD, len(x)):
        one = t[i : i + 1].contiguous()
        with pytest.raises(ValueError, match="past what a KVarN record holds"):
            kk.quantize_tiles(one, one, PRESET)
        with pytest.raises(ValueError, match="past what a KVarN record holds"):
            quantize_tiles(one.float().cpu().numpy(), one.float().cpu().numpy(), PRESET)


def _check_store_kv_counts(device: str, dtype: torch.dtype) -> None:
    """store_kv saturates what no record holds and counts it (keys and values separately)."""
    cache = unwritten_cache(4, 1, tile_layout(PRESET, D).tile_bytes, device)
    staging = nan_like_staging(kk.staging_shape(2, 1, D, PRESET), dtype, device)
    table = np.array([[2, 1], [0, 3]], dtype=np.int32)
    plan = kk.plan_store([0, 0], [G + 3, G], None, [0, 1], table, PRESET).to(device)
    x = make_kv((2 * G + 3, 1, D), "gaussian", 7)
    x[:G] *= np.float32(1e25)  # the first request's tile: keys and values past any record
    x[G + 3 :] *= np.float32(1e8) / np.abs(x[G + 3 :]).max()  # the second's: held
    x[G + 3 + 5, 0, 2] = BF16_MAX  # ... but for one value past any record
    kv = torch.from_numpy(x).to(dtype).to(device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    key = kv.clone()
    key[G + 3 + 5, 0, 2] = 1.0  # the second request's keys stay within range
    kk.store_kv(key, kv, cache, staging, plan, PRESET, overflow_count=count)
    assert int(count.item()) == 3
    records = cache.cpu().numpy()
    k, v = decode_tiles(records[[2, 0], 0], PRESET, D)
    assert np.isfinite(k).all() and np.isfinite(v).all()
    assert np.abs(k[0]).max() > 1e8 and np.abs(v[1]).max() > 1e8
    # the held tile's keys come back within the format's error
    k_rot = as_dtype(rotate(key[G + 3 :].float().cpu().numpy()[:, 0], axis=-1), dtype)
    rel = np.linalg.norm(k[1] - k_rot) / np.linalg.norm(k_rot)
    assert rel < 0.1, rel
    with pytest.raises(ValueError, match="overflow_count"):
        kk.store_kv(key, kv, cache, staging, plan, PRESET, overflow_count=count.long())


def _check_attention(device: str, dtype: torch.dtype) -> None:
    """Decode attention over records holding tiles of 1e8 against the reference (every token
    in records: exact staged tokens are scored with fp16 operands, which saturate at 65504)."""
    k = make_kv((2 * G, 1, D), "outlier_channels", 11)
    v = make_kv((2 * G, 1, D), "gaussian", 12)
    k, v = (x * np.float32(1e8) / np.abs(x).max() for x in (k, v))
    batch = build_paged([(k, v)], PRESET, dtype, "cpu")
    q = make_kv((1, 4, D), "gaussian", 13) * np.float32(1e-8)
    out = kk.decode_attention(
        torch.from_numpy(q).to(dtype).to(device), batch.kv_cache.to(device),
        batch.staging.to(device), batch.block_table.to(device), batch.seq_lens.to(device),
        batch.quantized_lens.to(device), batch.staging_slots.to(device), PRESET, D**-0.5,
    )  # fmt: skip
    got = out.float().cpu().numpy()
    assert np.isfinite(got).all()
    want = reference_attention(as_dtype(q, dtype), batch.refs[0], D**-0.5)
    assert_close_rms(want, got, 1e-4 if dtype == torch.float32 else 2.5e-2, what="1e8 tiles")


def _range_cases(g: int, d: int, magnitudes: list[float]) -> list[tuple[str, np.ndarray]]:
    """``(name, [g, d] float32 tile)`` per magnitude: a whole tile at it and an ordinary tile
    (largest magnitude 1) with one element at it."""
    x = make_kv((2 * len(magnitudes), g, d), "outlier_channels", 21)
    x = x / np.abs(x).max(axis=(-2, -1), keepdims=True)
    cases = []
    for i, m in enumerate(magnitudes):
        cases.append((f"tile {m:g}", (x[2 * i].astype(np.float64) * m).astype(np.float32)))
        single = x[2 * i + 1].copy()
        single[5, 9] = m
        cases.append((f"outlier {m:g}", single))
    return cases


def _check_store_kv_range(
    device: str, dtype: torch.dtype, preset: str, d: int, magnitudes: list[float]
) -> None:
    """The serving store (``store_kv``) at ``preset``'s tile: for each case, its keys and then
    its values in KV head 1 (head 0 ordinary), one tile per call. The kernel saturates and
    counts exactly the tile halves the reference rejects (``overflow="raise"``); a held one
    decodes within 5% of the reference's own error on the same rotated, ``dtype``-rounded
    tokens (the format's error: records are exact under powers of two), a saturated one
    decodes finite, and head 0's records are unaffected."""
    g = tile_layout(preset, d).group_size
    ordinary = make_kv((g, 2, d), "gaussian", 22)
    ordinary /= np.abs(ordinary).max()
    table = np.array([[1]], dtype=np.int32)
    plan = kk.plan_store([0], [g], None, [0], table, preset).to(device)
    decisions = []
    for name, tile in _range_cases(g, d, magnitudes):
        for half in (0, 1):  # keys, values
            k, v = ordinary.copy(), ordinary[::-1].copy()
            (k, v)[half][:, 1] = tile
            kt, vt = (torch.from_numpy(x).to(dtype).to(device) for x in (k, v))
            cache = unwritten_cache(2, 2, tile_layout(preset, d).tile_bytes, device)
            staging = nan_like_staging(kk.staging_shape(1, 2, d, preset), dtype, device)
            count = torch.zeros(1, dtype=torch.int32, device=device)
            kk.store_kv(kt, vt, cache, staging, plan, preset, overflow_count=count)
            # the reference's decision on the same (dtype-rounded) tokens, original frame
            orig = [x.float().cpu().numpy()[:, 1] for x in (kt, vt)]
            try:
                quantize_tiles(orig[0], orig[1], preset)
                rejected = False
            except ValueError as exc:
                assert "past what a KVarN record holds" in str(exc), exc
                rejected = True
            what = f"{preset} {name} {('keys', 'values')[half]}"
            assert int(count.item()) == int(rejected), what
            decisions.append(rejected)
            records = cache[1].cpu().numpy()  # [KV heads, tile bytes]
            got_kv = decode_tiles(records[1], preset, d)
            assert all(np.isfinite(x).all() for x in got_kv), what
            head0 = decode_tiles(records[0], preset, d)[half]
            ref0 = as_dtype(rotate((k, v)[half][:, 0], axis=-1), dtype)
            assert np.linalg.norm(head0 - ref0) < 0.5 * np.linalg.norm(ref0), what
            if rejected:
                continue
            # held: the tokens as the store sees them (rotated, rounded to dtype), encoded by
            # the reference, give the format's error there
            rot = [as_dtype(rotate(x, axis=-1), dtype) for x in orig]
            exact = rot[half].astype(np.float64)
            err = np.linalg.norm(got_kv[half] - exact) / np.linalg.norm(exact)
            ref = decode_tiles(encode_tiles(rot[0], rot[1], preset), preset, d)[half]
            ref_err = np.linalg.norm(ref - exact) / np.linalg.norm(exact)
            assert err <= 1.05 * ref_err + 1e-6, (what, err, ref_err)
    # the magnitudes below about 5.4e8 are held, the larger ones saturate (docs/reliability.md)
    want_rejected = [m > 5.4e8 for m in magnitudes for _ in range(4)]
    assert decisions == want_rejected, decisions


def _check_store_kv_range_small(device: str, dtype: torch.dtype) -> None:
    _check_store_kv_range(device, dtype, PRESET, D, [1e5, 1e20])


CHECKS = [_check_store, _check_store_kv_counts, _check_attention, _check_store_kv_range_small]


@pytest.mark.interpreter
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_values_cpu(check: object, dtype: torch.dtype) -> None:
    check("cpu", dtype)  # type: ignore[operator]


@pytest.mark.gpu
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_values_gpu(check: object, dtype: torch.dtype) -> None:
    check("cuda", dtype)  # type: ignore[operator]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("preset", "d"), [("kvarn_k4v2_g128", 128), ("kvarn_k2v2_g128", 256), ("kvarn_k4v4_g64", 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_range_at_real_tiles_gpu(preset: str, d: int, dtype: torch.dtype) -> None:
    """The serving store at the presets' real tiles, every magnitude, keys and values apart."""
    _check_store_kv_range("cuda", dtype, preset, d, MAGNITUDES)


@pytest.mark.gpu
def test_warmup_compiles_the_counting_store() -> None:
    """kvarn-vllm passes a counter to every store: warmup(count_overflow=True) compiles that
    variant, so serving compiles nothing more for it."""
    preset, d, dtype = "kvarn_k4v2_g128", 128, torch.bfloat16
    kk.warmup(preset, d, 32, 8, dtype, "cuda", count_overflow=True)
    before = kk.compiled_variants()
    g = tile_layout(preset, d).group_size
    cache = unwritten_cache(4, 8, tile_layout(preset, d).tile_bytes, "cuda")
    staging = kk.staging_shape(2, 8, d, preset)
    staging = torch.zeros(staging, dtype=dtype, device="cuda")
    table = np.array([[1, 2], [3, 0]], dtype=np.int32)
    plan = kk.plan_store([0, 0], [g + 5, 7], None, [0, 1], table, preset).to("cuda")
    kv = torch.randn((g + 12, 8, d), dtype=torch.float32).to("cuda", dtype)
    # kvarn-vllm's counters are views 16 bytes apart in one buffer (kvarn_vllm.overflow)
    count = torch.zeros(8, dtype=torch.int32, device="cuda")[4:5]
    kk.store_kv(kv, kv.clone(), cache, staging, plan, preset, overflow_count=count)
    torch.cuda.synchronize()
    assert kk.compiled_variants() == before and int(count.item()) == 0
