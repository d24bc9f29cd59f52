"""rotate/unrotate and dequantize against kvarn-math."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import examples
from kvarn_math import PRESETS, get_preset, random_signs
from kvarn_math import decode_tiles as ref_decode_tiles
from kvarn_math import dequantize_tiles as ref_dequantize_tiles
from kvarn_math import quantize_tiles as ref_quantize_tiles
from kvarn_math import rotate as ref_rotate
from kvarn_math import unrotate as ref_unrotate
from kvarn_math.testing import make_kv

pytestmark = pytest.mark.interpreter


@examples(15)
@given(
    st.sampled_from([2, 8, 64, 128, 256, 512]),
    st.lists(st.integers(1, 5), min_size=0, max_size=2),
    st.booleans(),
    st.integers(0, 2**31),
)
def test_rotate_is_bit_exact_in_fp32(d: int, lead: list[int], signed: bool, seed: int) -> None:
    x = make_kv((*lead, d), "heavy_tailed", seed)
    signs = random_signs(d, seed) if signed else None
    got = kk.rotate(torch.from_numpy(x), signs=signs)
    np.testing.assert_array_equal(got.numpy(), ref_rotate(x, signs=signs))
    back = kk.unrotate(got, signs=signs)
    np.testing.assert_array_equal(
        back.numpy(), ref_unrotate(ref_rotate(x, signs=signs), signs=signs)
    )
    np.testing.assert_allclose(back.numpy(), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotate_half_rounds_the_fp32_result(dtype: torch.dtype) -> None:
    x = torch.from_numpy(make_kv((3, 4, 128), "gaussian", 0)).to(dtype)
    got = kk.rotate(x, axis=1 - 2)
    want = torch.from_numpy(ref_rotate(x.float().numpy())).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rotate_other_axis() -> None:
    x = make_kv((64, 3), "gaussian", 1)
    np.testing.assert_array_equal(
        kk.rotate(torch.from_numpy(x), axis=0).numpy(), ref_rotate(x, axis=0)
    )


def test_rotate_guards() -> None:
    with pytest.raises(ValueError, match="power of two"):
        kk.rotate(torch.zeros(3, 48))
    with pytest.raises(ValueError, match="axis must be in"):
        kk.rotate(torch.zeros(3, 64), axis=2)
    with pytest.raises(ValueError, match="x must have dtype"):
        kk.rotate(torch.zeros(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="signs must have shape"):
        kk.rotate(torch.zeros(3, 64), signs=np.ones(32))


@examples(10)
@given(st.sampled_from(list(PRESETS)), st.sampled_from([64, 128]), st.integers(0, 2**31))
def test_decode_and_dequantize_tiles_match_reference(preset: str, d: int, seed: int) -> None:
    g = get_preset(preset).group_size
    k = make_kv((2, g, d), "outlier_channels", seed)
    v = make_kv((2, g, d), "gaussian", seed + 1)
    records = ref_quantize_tiles(k, v, preset)
    for ours, ref in (
        (kk.decode_tiles, ref_decode_tiles),
        (kk.dequantize_tiles, ref_dequantize_tiles),
    ):
        kg, vg = ours(torch.from_numpy(records), preset, d)
        kw, vw = ref(records, preset, d)
        assert kg.dtype == torch.float32 and kg.shape == kw.shape
        # fp32 with possibly fused multiply-adds on the GPU: a few ulp.
        np.testing.assert_allclose(kg.numpy(), kw, rtol=1e-5, atol=1e-5 * np.abs(kw).max())
        np.testing.assert_allclose(vg.numpy(), vw, rtol=1e-5, atol=1e-5 * np.abs(vw).max())


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_dequantize(rotated: bool, dtype: torch.dtype) -> None:
    preset, d, h = "kvarn_k4v2_g64", 64, 2
    k = make_kv((3, h, 64, d), "heavy_tailed", 4)
    v = make_kv((3, h, 64, d), "gaussian", 5)
    records = ref_quantize_tiles(k, v, preset)  # [3, h, tile_bytes]
    cache = torch.full((6, h, records.shape[-1]), 0xFF, dtype=torch.uint8)
    blocks = [4, 0, 2]
    for i, b in enumerate(blocks):
        cache[b] = torch.from_numpy(records[i])
    ids = torch.tensor([2, 4], dtype=torch.int32)  # tiles 2 then 0
    kg, vg = kk.dequantize(cache, ids, preset, d, dtype=dtype, rotated=rotated)
    ref = ref_decode_tiles if rotated else ref_dequantize_tiles
    kw, vw = ref(records[[2, 0]], preset, d)  # [2, h, G, D]
    want_k = torch.from_numpy(kw).transpose(1, 2).reshape(128, h, d)
    want_v = torch.from_numpy(vw).transpose(1, 2).reshape(128, h, d)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert kg.dtype == dtype and kg.shape == (128, h, d)
    torch.testing.assert_close(kg.float(), want_k, **tol)
    torch.testing.assert_close(vg.float(), want_v, **tol)
    # Into slices of a preallocated [2, T, H, D] workspace: same values, rows around untouched.
    ws = torch.full((2, 200, h, d), 7.0, dtype=dtype)
    ko, vo = kk.dequantize(
        cache, ids, preset, d, dtype=dtype, rotated=rotated, out=(ws[0, 10:138], ws[1, 10:138])
    )
    assert ko.data_ptr() == ws[0, 10].data_ptr()
    torch.testing.assert_close(ws[0, 10:138], kg)
    torch.testing.assert_close(ws[1, 10:138], vg)
    assert bool((ws[:, :10] == 7).all()) and bool((ws[:, 138:] == 7).all())


def test_dequantize_out_guards() -> None:
    preset, d, h = "kvarn_k4v2_g64", 64, 2
    records = ref_quantize_tiles(
        make_kv((1, h, 64, d), "gaussian", 1), make_kv((1, h, 64, d), "gaussian", 2), preset
    )
    cache = torch.from_numpy(records.copy())
    ids = torch.zeros(1, dtype=torch.int32)
    ok = torch.empty(64, h, d)
    with pytest.raises(ValueError, match=r"out\[0\] \(k\) must be torch.float32 \[64, 2, 64\]"):
        kk.dequantize(cache, ids, preset, d, dtype=torch.float32, out=(torch.empty(63, h, d), ok))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        bad = torch.empty(64, h, 2 * d)[:, :, ::2]
        kk.dequantize(cache, ids, preset, d, dtype=torch.float32, out=(ok, bad))
    with pytest.raises(ValueError, match="share strides"):
        other = torch.empty(64, 2 * h, d)[:, :h]
        kk.dequantize(cache, ids, preset, d, dtype=torch.float32, out=(ok, other))
    with pytest.raises(ValueError, match="tuple"):
        kk.dequantize(cache, ids, preset, d, dtype=torch.float32, out=ok)


def test_dequantize_guards() -> None:
    cache = torch.zeros(2, 1, 10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        kk.dequantize(cache, torch.zeros(1, dtype=torch.int32), "kvarn_k4v2_g64", 64)
    with pytest.raises(ValueError, match="records must be uint8"):
        kk.decode_tiles(torch.zeros(3, dtype=torch.uint8), "kvarn_k4v2_g64", 64)
