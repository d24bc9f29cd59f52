"""kvarn_vllm.settings: one validated object for every KVARN_VLLM_* variable."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import kvarn_vllm
import pytest
from kvarn_vllm.settings import VllmSettings


def test_defaults_with_nothing_set() -> None:
    got = VllmSettings.from_env({})
    assert got == VllmSettings()
    assert got.exact_sink and got.recent_tiles == 1 and got.key_frame == "auto"
    assert got.window_keys is None and got.verify_as_decode is None  # preset / speculation
    assert got.spec_full_graphs and got.dense_context and got.warmup


def test_blank_means_unset_and_bad_values_name_the_variable() -> None:
    got = VllmSettings.from_env({"KVARN_VLLM_RECENT_TILES": " ", "KVARN_VLLM_WINDOW_KEYS": "0"})
    assert got.recent_tiles == 1 and got.window_keys is False
    with pytest.raises(ValueError, match="KVARN_VLLM_WARMUP must be 0 or 1, got 'no'"):
        VllmSettings.from_env({"KVARN_VLLM_WARMUP": "no"})
    with pytest.raises(ValueError, match="KVARN_VLLM_KEY_FRAME must be one of auto, rotated"):
        VllmSettings.from_env({"KVARN_VLLM_KEY_FRAME": "raw"})


def test_every_variable_the_sources_name_is_a_setting() -> None:
    """Every ``KVARN_VLLM_*`` name in the package's sources is a field's variable."""
    fields = {f.metadata["env"] for f in dataclasses.fields(VllmSettings)}
    named = set()
    for path in Path(kvarn_vllm.__file__).parent.rglob("*.py"):
        named |= set(re.findall(r"KVARN_VLLM_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named <= fields, sorted(named - fields)
