import numpy as np
import pytest
from hypothesis import given
from kvarn_math.layout import (
    FIELD_ALIGNMENT,
    PRESETS,
    SUPPORTED_HEAD_DIMS,
    Preset,
    get_preset,
    tile_layout,
)
from kvarn_math.testing import presets
from kvarn_math.tile import quantize_tiles, read_fields


def test_published_sizes() -> None:
    import kvarn_math

    # one-byte balancing factors (format 2) plus the 16-byte flags field (format 3)
    assert kvarn_math.FORMAT_VERSION == 3
    lay = tile_layout("kvarn_k4v2_g128", 128)
    assert lay.tile_bytes == 13_568 + 16
    assert lay.bytes_per_token_per_head == 106.125
    assert round(lay.ratio_to_fp16, 2) == 4.82
    assert tile_layout("kvarn_k4v4_g128", 128).bytes_per_token_per_head == 138.125
    assert tile_layout("kvarn_k4v2_g64", 128).bytes_per_token_per_head == 111.25
    assert tile_layout("kvarn_k4v4_g64", 128).bytes_per_token_per_head == 143.25


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_fields_are_contiguous_aligned_and_unpadded(name: str, head_dim: int) -> None:
    p = get_preset(name)
    lay = tile_layout(p, head_dim)
    g, d = p.group_size, head_dim
    expected = (
        d * g * p.key_bits // 8
        + 2 * d * 2
        + g  # K codes, fp16 scale and zero, log8 factors
        + g * d * p.value_bits // 8
        + d
        + 2 * g * 2  # V codes, log8 factors, fp16 scale and zero
        + 16  # flags
    )
    assert lay.tile_bytes == expected
    offset = 0
    for f in lay.fields:
        assert f.offset == offset and f.offset % FIELD_ALIGNMENT == 0
        assert f.nbytes == int(np.prod(f.shape)) * np.dtype(f.dtype).itemsize
        offset = f.end
    # no power-of-two padding: D=256 k4v4 saves more than 3.5x (the fork pads it to 2x)
    assert lay.ratio_to_fp16 > 3.3
    assert lay.page_bytes(8) == 8 * lay.tile_bytes


@given(presets())
def test_record_size_equals_bytes_written_and_metadata_roundtrips(p: Preset) -> None:
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, p.group_size, 64)).astype(np.float32)
    records = quantize_tiles(k, v, p)
    assert records.shape == (2, tile_layout(p, 64).tile_bytes)
    fields = read_fields(records, p.name, 64)
    assert fields.k_codes.shape == (2, 64, p.group_size) and fields.k_codes.max() < 2**p.key_bits
    assert fields.v_codes.shape == (2, p.group_size, 64) and fields.v_codes.max() < 2**p.value_bits
    assert get_preset(p.name) == p == Preset.from_bits(p.key_bits, p.value_bits, p.group_size)


def test_errors_list_what_is_supported() -> None:
    with pytest.raises(ValueError, match="kvarn_k4v2_g128"):
        get_preset("kvarn_k5v2_g128")
    with pytest.raises(ValueError, match=r"\(64, 128, 256, 512\)"):
        tile_layout("kvarn_k4v2_g128", 96)
    with pytest.raises(ValueError, match=r"group_size must be one of \(64, 128\)"):
        Preset.from_bits(4, 2, 32)
    with pytest.raises(ValueError, match="key_bits"):
        Preset.from_bits(9, 2, 128)
    with pytest.raises(ValueError, match="name must be"):
        Preset("kvarn_fast", 4, 2, 128)
    with pytest.raises(KeyError, match="no field"):
        tile_layout("kvarn_k4v2_g128", 64).field("nope")
