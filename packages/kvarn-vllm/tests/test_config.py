"""Preset parsing: kv_cache_dtype strings to a frozen KvarnConfig, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
from kvarn_math.layout import DEFAULT_PRESET, PRESETS
from kvarn_vllm.config import (
    KvarnConfig,
    default_window_keys,
    is_kvarn_dtype,
    parse_kv_cache_dtype,
    preset_names,
    staging_tiles_for,
)


def test_preset_names_cover_every_kvarn_math_preset_default_first():
    names = preset_names()
    assert names[0] == DEFAULT_PRESET
    assert sorted(names) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parse_every_preset(name, monkeypatch):
    monkeypatch.delenv("KVARN_VLLM_RECENT_TILES", raising=False)
    monkeypatch.delenv("KVARN_VLLM_WINDOW_KEYS", raising=False)
    cfg = parse_kv_cache_dtype(name)
    assert cfg.name == name
    assert cfg.preset is PRESETS[name]
    assert cfg.block_size == PRESETS[name].group_size
    assert cfg.staging_tiles == 1
    assert cfg.sink  # default: the first tile stays exact
    assert cfg.recent_tiles == 1  # default: and the last complete one
    assert cfg.ring_tiles == 2
    assert cfg.ring_tokens == 2 * cfg.block_size
    if PRESETS[name].key_bits == 4:
        # default: the exact tiles keep only their values: the keys of the open tile, the
        # values of the sink, recent and open tiles (4 half tiles)
        assert not cfg.window_keys and cfg.key_tiles == 1
        assert cfg.staging_tokens == 2 * cfg.block_size
    else:
        # 2- and 3-bit keys: the exact tiles keep their keys too (sink, recent, open tiles)
        assert cfg.window_keys and cfg.key_tiles is None
        assert cfg.staging_tokens == 3 * cfg.block_size


def test_window_keys_default_follows_the_key_bits(monkeypatch):
    monkeypatch.delenv("KVARN_VLLM_WINDOW_KEYS", raising=False)
    assert [p for p in sorted(PRESETS) if default_window_keys(p)] == [
        "kvarn_k2v2_g128",
        "kvarn_k3v2_g128",
    ]
    assert default_window_keys(PRESETS["kvarn_k4v4_g64"]) is False
    with pytest.raises(ValueError, match="kvarn_k9v2_g128"):
        default_window_keys("kvarn_k9v2_g128")
    # the environment overrides the preset's default either way
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", "0")
    assert not parse_kv_cache_dtype("kvarn_k2v2_g128").window_keys
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", "1")
    assert parse_kv_cache_dtype("kvarn_k4v2_g128").window_keys


def test_window_keys_env(monkeypatch):
    monkeypatch.delenv("KVARN_VLLM_RECENT_TILES", raising=False)
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", "1")
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    assert cfg.window_keys and cfg.key_tiles is None
    assert cfg.staging_tokens == 3 * 128  # keys and values of the sink, recent and open tiles
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", "keys")
    with pytest.raises(ValueError, match="KVARN_VLLM_WINDOW_KEYS must be 0 or 1, got 'keys'"):
        parse_kv_cache_dtype("kvarn_k4v2_g128")


def test_key_frame_env(monkeypatch):
    monkeypatch.delenv("KVARN_VLLM_KEY_FRAME", raising=False)
    cfg = parse_kv_cache_dtype("kvarn_k2v2_g128")
    assert cfg.key_frame == "auto" and cfg.mixed_key_frames  # default: chosen per tile
    monkeypatch.setenv("KVARN_VLLM_KEY_FRAME", "rotated")
    cfg = parse_kv_cache_dtype("kvarn_k2v2_g128")
    assert cfg.key_frame == "rotated" and not cfg.mixed_key_frames
    monkeypatch.setenv("KVARN_VLLM_KEY_FRAME", "raw")
    with pytest.raises(ValueError, match="KVARN_VLLM_KEY_FRAME must be one of auto, rotated"):
        parse_kv_cache_dtype("kvarn_k2v2_g128")
    with pytest.raises(ValueError, match="key_frame must be one of"):
        KvarnConfig(preset=PRESETS["kvarn_k2v2_g128"], key_frame="raw")


def test_sink_env(monkeypatch):
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", "0")
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "0")
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    assert not cfg.sink and cfg.sink_rows == 0 and cfg.staging_tokens == 128
    monkeypatch.setenv("KVARN_VLLM_EXACT_SINK", "yes")
    with pytest.raises(ValueError, match="KVARN_VLLM_EXACT_SINK must be 0 or 1, got 'yes'"):
        parse_kv_cache_dtype("kvarn_k4v2_g128")


def test_recent_env(monkeypatch):
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "2")
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g64", num_speculative_tokens=3)
    assert (cfg.staging_tiles, cfg.recent_tiles, cfg.ring_tiles) == (2, 2, 4)
    # the key ring of the 2 open tiles, the values of the sink and the 4 ring tiles
    assert cfg.ring_tokens == 256 and cfg.staging_tokens == (2 + 5) * 64 // 2
    monkeypatch.setenv("KVARN_VLLM_WINDOW_KEYS", "1")
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g64", num_speculative_tokens=3)
    assert cfg.staging_tokens == 320
    monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", "0")
    assert parse_kv_cache_dtype("kvarn_k4v2_g128").ring_tokens == 128
    for bad in ("-1", "one", "5", "1.5"):
        monkeypatch.setenv("KVARN_VLLM_RECENT_TILES", bad)
        with pytest.raises(
            ValueError, match=f"KVARN_VLLM_RECENT_TILES must be an integer from 0 to 4.*{bad!r}"
        ):
            parse_kv_cache_dtype("kvarn_k4v2_g128")


def test_verify_as_decode_env(monkeypatch):
    """Unset: verify blocks as decode rows with speculative tokens (off without: there are no
    verify blocks); 0 and 1 decide alone."""
    monkeypatch.delenv("KVARN_VLLM_VERIFY_AS_DECODE", raising=False)
    assert parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4).verify_as_decode
    assert not parse_kv_cache_dtype("kvarn_k4v2_g128").verify_as_decode
    assert not parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=0).verify_as_decode
    monkeypatch.setenv("KVARN_VLLM_VERIFY_AS_DECODE", "0")
    assert not parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4).verify_as_decode
    monkeypatch.setenv("KVARN_VLLM_VERIFY_AS_DECODE", "1")
    assert parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4).verify_as_decode
    assert parse_kv_cache_dtype("kvarn_k4v2_g128").verify_as_decode
    monkeypatch.setenv("KVARN_VLLM_VERIFY_AS_DECODE", "yes")
    with pytest.raises(ValueError, match="KVARN_VLLM_VERIFY_AS_DECODE must be 0 or 1"):
        parse_kv_cache_dtype("kvarn_k4v2_g128")


def test_batch_invariant_env(monkeypatch):
    monkeypatch.delenv("KVARN_KERNELS_BATCH_INVARIANT", raising=False)
    assert not parse_kv_cache_dtype("kvarn_k4v2_g128").batch_invariant
    assert not parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4).batch_invariant
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", "1")
    assert parse_kv_cache_dtype("kvarn_k4v2_g128").batch_invariant
    assert parse_kv_cache_dtype("kvarn_k4v2_g128", num_speculative_tokens=4).batch_invariant
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", "on")
    with pytest.raises(ValueError, match="KVARN_KERNELS_BATCH_INVARIANT must be 0 or 1"):
        parse_kv_cache_dtype("kvarn_k4v2_g128")


def test_config_is_frozen():
    cfg = parse_kv_cache_dtype("kvarn_k4v2_g128")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.staging_tiles = 2  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["kvarn_k9v9_g128", "kvarn_k4v2_g32", "kvarn_", "kvarn_k4v2"])
def test_unknown_kvarn_name_lists_expected(bad):
    with pytest.raises(ValueError) as err:
        parse_kv_cache_dtype(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    assert DEFAULT_PRESET in msg and "kvarn_k4v4_g64" in msg


@pytest.mark.parametrize("bad", ["auto", "fp8", "", "KVARN_K4V2_G128"])
def test_non_kvarn_dtype_rejected(bad):
    assert not is_kvarn_dtype(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        parse_kv_cache_dtype(bad)


def test_is_kvarn_dtype_type_safe():
    assert is_kvarn_dtype("kvarn_k4v2_g128")
    assert not is_kvarn_dtype(None)
    assert not is_kvarn_dtype(128)


def test_staging_tiles_for_speculation():
    assert staging_tiles_for(None, 128) == 1
    assert staging_tiles_for(0, 128) == 1
    assert staging_tiles_for(1, 128) == 2
    assert staging_tiles_for(8, 64) == 2
    assert staging_tiles_for(64, 128) == 2
    assert staging_tiles_for(65, 128) == 3
    assert parse_kv_cache_dtype("kvarn_k4v2_g64", num_speculative_tokens=3).staging_tiles == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        staging_tiles_for(-1, 128)


def test_frame_queries_with_auto_key_frames_under_speculation_only():
    """The store stages last-position queries only where a step can commit a tile from
    staging (speculative decoding) and the key frame is chosen from the queries."""
    preset = PRESETS["kvarn_k4v2_g128"]
    assert KvarnConfig(preset=preset, staging_tiles=2, key_frame="auto").frame_queries
    assert not KvarnConfig(preset=preset, staging_tiles=1, key_frame="auto").frame_queries
    assert not KvarnConfig(preset=preset, staging_tiles=2, key_frame="rotated").frame_queries


def test_config_validation():
    preset = PRESETS["kvarn_k4v2_g128"]
    with pytest.raises(ValueError, match="staging_tiles"):
        KvarnConfig(preset=preset, staging_tiles=0)
    with pytest.raises(ValueError, match="recent_tiles must be an int >= 0, got -1"):
        KvarnConfig(preset=preset, recent_tiles=-1)
    with pytest.raises(ValueError, match="Preset"):
        KvarnConfig(preset="kvarn_k4v2_g128")  # type: ignore[arg-type]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_served_head_dims(head_dim):
    parse_kv_cache_dtype("kvarn_k4v2_g128").check_head_dim(head_dim)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 512])
def test_unserved_head_dims(head_dim):
    with pytest.raises(ValueError, match=f"got {head_dim}"):
        parse_kv_cache_dtype("kvarn_k4v2_g128").check_head_dim(head_dim)


@pytest.mark.parametrize("raw", [None, "", " ", "0", "1", " 1 ", "true", "2"])
def test_invariant_flag_parsed_as_the_kernels_parse_it(monkeypatch, raw):
    """kvarn-vllm reads KVARN_KERNELS_BATCH_INVARIANT without importing the kernels; it must
    accept and reject exactly what kvarn_kernels.settings.KernelSettings does."""
    from kvarn_kernels.settings import KernelSettings
    from kvarn_vllm.config import INVARIANT_ENV, invariant_from_env

    env = {} if raw is None else {INVARIANT_ENV: raw}
    if raw is None:
        monkeypatch.delenv(INVARIANT_ENV, raising=False)
    else:
        monkeypatch.setenv(INVARIANT_ENV, raw)
    try:
        expected = KernelSettings.from_env(env).batch_invariant
    except ValueError:
        with pytest.raises(ValueError, match=INVARIANT_ENV):
            invariant_from_env()
    else:
        assert invariant_from_env() is expected
