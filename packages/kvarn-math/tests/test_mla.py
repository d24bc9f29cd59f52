"""The MLA latent tile format: layout, round trip, row independence, absorbed attention."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvarn_math.mla import (
    DEFAULT_MLA_PRESET,
    MLA_PRESETS,
    MLAPreset,
    decode_latent_tiles,
    encode_latent_tiles,
    get_mla_preset,
    mla_expanded_attention,
    mla_format_table,
    mla_layout,
    mla_reference_attention,
    roundtrip_latent,
)
from kvarn_math.mla_recipes import LatentRecipe, bf16_round, rope_bytes, rope_roundtrip
from kvarn_math.testing import DISTRIBUTIONS, make_kv


def _tile(
    preset: MLAPreset, dist: str, seed: int, tiles: int = 1, width: int = 512, rope: int = 64
):
    g = preset.group_size
    lat = make_kv((tiles, g, width), dist, seed)
    pe = make_kv((tiles, g, rope), dist, seed + 1)
    return lat, pe


def test_default_preset_bytes_meet_the_target() -> None:
    lay = mla_layout(DEFAULT_MLA_PRESET, 512, 64)
    assert lay.bytes_per_token == 330  # 256 codes + 8 group params + 64 rope codes + 2 scale
    assert lay.bf16_bytes_per_token == 1152
    assert mla_layout("kvarn_mla_l2_g128").bytes_per_token == 202
    assert mla_layout("kvarn_mla_l4_g64").bytes_per_token == 330
    for p in MLA_PRESETS.values():
        for width in (256, 512):
            lay = mla_layout(p, width, 64)
            end = 0
            for f in lay.fields:
                assert f.offset == end and f.offset % 16 == 0
                end = f.end
            assert end == lay.tile_bytes
    assert "kvarn_mla_l4_g128" in mla_format_table()


def test_preset_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="unknown KVarN MLA preset 'kvarn_k4v2_g128'"):
        get_mla_preset("kvarn_k4v2_g128")
    with pytest.raises(ValueError, match="latent_bits must be 2, 4 or 8"):
        MLAPreset.from_bits(3, 128)
    with pytest.raises(ValueError, match="group_size"):
        MLAPreset.from_bits(4, 32)
    with pytest.raises(ValueError, match="latent_dim must be one of"):
        mla_layout(DEFAULT_MLA_PRESET, 384, 64)
    with pytest.raises(ValueError, match="rope_dim must be one of"):
        mla_layout(DEFAULT_MLA_PRESET, 512, 48)


def test_encode_rejects_bad_inputs() -> None:
    p = get_mla_preset(DEFAULT_MLA_PRESET)
    lat, pe = _tile(p, "gaussian", 0)
    with pytest.raises(ValueError, match="hold 128 tokens"):
        encode_latent_tiles(lat[:, :64], pe[:, :64], p)
    with pytest.raises(ValueError, match="share leading axes"):
        encode_latent_tiles(lat, pe[:, :64], p)
    lat[0, 5, 7] = np.nan
    with pytest.raises(ValueError, match=r"latent holds nan at \(0, 5, 7\)"):
        encode_latent_tiles(lat, pe, p)
    with pytest.raises(ValueError, match="records at L=512, R=64 are 42240 bytes"):
        decode_latent_tiles(np.zeros((1, 100), np.uint8), p)


@given(
    name=st.sampled_from(sorted(MLA_PRESETS)),
    dist=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**16),
    width=st.sampled_from((256, 512)),
)
def test_roundtrip_error_is_half_a_step(name: str, dist: str, seed: int, width: int) -> None:
    p = get_mla_preset(name)
    lat, pe = _tile(p, dist, seed, width=width)
    rec = encode_latent_tiles(lat, pe, p)
    back, back_pe = decode_latent_tiles(rec, p, width, 64)
    groups = lat.reshape(1, p.group_size, -1, p.channel_group)
    span = groups.max(-1) - groups.min(-1)
    step = span / (2**p.latent_bits - 1)
    err = np.abs(back - lat).reshape(groups.shape).max(-1)
    # half a step, plus the fp16 rounding of the step and the minimum
    assert (err <= step * (0.5 + 2**-9) + np.abs(groups).max(-1) * 2**-10 + 1e-6).all()
    pe_step = np.abs(pe).max(-1) / 127
    assert (np.abs(back_pe - pe).max(-1) <= pe_step * (0.5 + 2**-9) + 1e-7).all()


@given(dist=st.sampled_from(DISTRIBUTIONS), seed=st.integers(0, 2**16), row=st.integers(0, 127))
def test_rows_are_independent(dist: str, seed: int, row: int) -> None:
    """A token's bytes depend only on that token (any chunking or order writes the same)."""
    p = get_mla_preset(DEFAULT_MLA_PRESET)
    lay = mla_layout(p)
    lat, pe = _tile(p, dist, seed)
    other_lat, other_pe = _tile(p, "heavy_tailed", seed + 7)
    other_lat[0, row], other_pe[0, row] = lat[0, row], pe[0, row]
    a, b = encode_latent_tiles(lat, pe, p)[0], encode_latent_tiles(other_lat, other_pe, p)[0]
    for f in lay.fields:
        per_row = f.nbytes // p.group_size
        sl = slice(f.offset + row * per_row, f.offset + (row + 1) * per_row)
        assert (a[sl] == b[sl]).all(), f.name


def test_zero_and_constant_rows_are_exact() -> None:
    p = get_mla_preset("kvarn_mla_l2_g128")
    lat = np.zeros((1, 128, 512), np.float32)
    lat[0, 3] = 0.75
    pe = np.zeros((1, 128, 64), np.float32)
    back, back_pe = decode_latent_tiles(encode_latent_tiles(lat, pe, p), p)
    assert np.array_equal(back, lat) and np.array_equal(back_pe, pe)


def test_absorbed_attention_equals_expanded() -> None:
    rng = np.random.default_rng(3)
    heads, dn, dv, width, rdim, t = 4, 32, 24, 256, 32, 70
    q_nope = rng.standard_normal((heads, dn))
    q_rope = rng.standard_normal((heads, rdim))
    lat = rng.standard_normal((t, width))
    pe = rng.standard_normal((t, rdim))
    w_uk = rng.standard_normal((heads, dn, width)) / 16
    w_uv = rng.standard_normal((heads, dv, width)) / 16
    scale = 1 / np.sqrt(dn + rdim)
    expanded = mla_expanded_attention(q_nope, q_rope, lat, pe, w_uk, w_uv, scale)
    q_lat = np.einsum("hdl,hd->hl", w_uk, q_nope)
    out_lat = mla_reference_attention(
        q_lat,
        q_rope,
        np.zeros((0, mla_layout(DEFAULT_MLA_PRESET, width, rdim).tile_bytes), np.uint8),
        lat,
        pe,
        DEFAULT_MLA_PRESET,
        scale,
    )
    absorbed = np.einsum("hdl,hl->hd", w_uv, out_lat.astype(np.float64))
    np.testing.assert_allclose(absorbed, expanded, rtol=1e-5, atol=1e-6)


@given(seed=st.integers(0, 2**16), tiles=st.integers(1, 3), tail=st.integers(0, 127))
def test_reference_attention_reads_tiles_then_tail(seed: int, tiles: int, tail: int) -> None:
    p = get_mla_preset(DEFAULT_MLA_PRESET)
    rng = np.random.default_rng(seed)
    lat, pe = _tile(p, "gaussian", seed, tiles=tiles)
    tail_lat = rng.standard_normal((tail, 512)).astype(np.float32)
    tail_pe = rng.standard_normal((tail, 64)).astype(np.float32)
    q_lat = rng.standard_normal((8, 512)) / 8
    q_pe = rng.standard_normal((8, 64))
    rec = encode_latent_tiles(lat, pe, p)
    out = mla_reference_attention(q_lat, q_pe, rec, tail_lat, tail_pe, p, 0.1)
    dec_lat, dec_pe = decode_latent_tiles(rec, p)
    keys = np.concatenate([dec_lat.reshape(-1, 512), tail_lat])
    pes = np.concatenate([dec_pe.reshape(-1, 64), tail_pe])
    s = 0.1 * (q_lat @ keys.T + q_pe @ pes.T)
    w = np.exp(s - s.max(-1, keepdims=True))
    expect = (w / w.sum(-1, keepdims=True)) @ keys
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)


def test_recipe_matching_the_format_agrees_with_it() -> None:
    """The sweep's simulation of the chosen recipe is the format (bytes and values)."""
    p = get_mla_preset(DEFAULT_MLA_PRESET)
    recipe = LatentRecipe("format", bits=4, axis="token", group=256, rope="int8")
    assert recipe.bytes_per_token(512, 64) == mla_layout(p).bytes_per_token
    lat, pe = _tile(p, "outlier_channels", 11, tiles=2)
    sim_lat, sim_pe = recipe.roundtrip(lat.reshape(256, 512), pe.reshape(256, 64))
    fmt_lat, fmt_pe = roundtrip_latent(lat.reshape(256, 512), pe.reshape(256, 64), p)
    np.testing.assert_allclose(sim_pe, fmt_pe, rtol=0, atol=0)
    # the format rounds step and zero to fp16 before coding; the simulation after: both are
    # within half a step, so they differ by at most about one step
    assert np.abs(sim_lat - fmt_lat).max() <= np.abs(lat).max() / 7


@pytest.mark.parametrize(
    "recipe",
    [
        LatentRecipe("a", rotate=True, varnorm=True),
        LatentRecipe("b", axis="channel", scales="log8", rope="bf16"),
        LatentRecipe("c", group=128, scales="log8", rope="fp8", bits=2),
    ],
)
def test_recipes_roundtrip_closely(recipe: LatentRecipe) -> None:
    lat = make_kv((256, 512), "gaussian", 5)
    pe = make_kv((256, 64), "gaussian", 6)
    back, back_pe = recipe.roundtrip(lat, pe)
    rel = np.linalg.norm(back - lat) / np.linalg.norm(lat)
    assert rel < (0.12 if recipe.bits == 4 else 0.7)
    assert np.linalg.norm(back_pe - pe) / np.linalg.norm(pe) < 0.05
    assert recipe.bytes_per_token(512, 64) > 512 * recipe.bits / 8


def test_rope_modes() -> None:
    x = np.array([[1.0, -3.0, 0.3333]], np.float32)
    assert np.array_equal(rope_roundtrip(x, "bf16"), bf16_round(x))
    assert rope_bytes(64, "int8") == 66 and rope_bytes(64, "bf16") == 128
    with pytest.raises(ValueError, match="rope mode must be one of"):
        rope_roundtrip(x, "fp4")


def test_recipe_groups_a_token() -> None:
    """``groups=n`` is ``group=L/n`` at any width, and its bytes are those of the real shape."""
    lat = make_kv((128, 512), "outlier_channels", 8)
    pe = make_kv((128, 64), "gaussian", 9)
    a = LatentRecipe("a", groups=2, rope="int8").roundtrip(lat, pe)[0]
    b = LatentRecipe("b", group=256, rope="int8").roundtrip(lat, pe)[0]
    assert np.array_equal(a, b)
    narrow = LatentRecipe("n", groups=2, rope="int8")
    assert narrow.bytes_per_token(512, 64) == 330
    c = narrow.roundtrip(lat[:, :256], pe)[0]
    d = LatentRecipe("d", group=128, rope="int8").roundtrip(lat[:, :256], pe)[0]
    assert np.array_equal(c, d)
