"""kvarn_kernels.settings: one validated object for every KVARN_KERNELS_* variable."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from kvarn_kernels import settings
from kvarn_kernels.settings import KernelSettings

SRC = Path(settings.__file__).parent


def _env_names() -> set[str]:
    return {f.metadata["env"] for f in dataclasses.fields(KernelSettings)}


def test_defaults_with_nothing_set() -> None:
    got = KernelSettings.from_env({})
    assert got == KernelSettings()
    assert (got.batch_invariant, got.fast_decode, got.fast_prefetch) == (False, True, 1)
    assert (got.invariant_split_tiles, got.warmup_threads) == (8, 4)
    assert (got.staged_splits, got.store_warps, got.git_sha, got.launch_override) == (
        None,
        None,
        None,
        {},
    )


def test_values_are_parsed_and_blank_means_unset() -> None:
    got = KernelSettings.from_env(
        {
            "KVARN_KERNELS_BATCH_INVARIANT": "1",
            "KVARN_KERNELS_FAST_DECODE": "0",
            "KVARN_KERNELS_FAST_PREFETCH": " 3 ",
            "KVARN_KERNELS_INVARIANT_SPLIT_TILES": "32",
            "KVARN_KERNELS_STAGED_SPLITS": "1",
            "KVARN_KERNELS_STORE_WARPS": "16",
            "KVARN_KERNELS_ATTN_LAUNCH": "SUB=64, num_warps=2",
            "KVARN_KERNELS_WARMUP_THREADS": "  ",
            "KVARN_GIT_SHA": "f8c4936",
        }
    )
    assert got.batch_invariant and not got.fast_decode
    assert (got.fast_prefetch, got.invariant_split_tiles, got.staged_splits) == (3, 32, 1)
    assert got.store_warps == 16 and got.launch_override == {"SUB": 64, "num_warps": 2}
    assert got.warmup_threads == 4 and got.git_sha == "f8c4936"


@pytest.mark.parametrize(
    ("name", "bad", "says"),
    [
        ("KVARN_KERNELS_BATCH_INVARIANT", "yes", "0 or 1"),
        ("KVARN_KERNELS_FAST_DECODE", "off", "0 or 1"),  # was silently 'on' before
        ("KVARN_KERNELS_AUTOTUNE", "true", "0 or 1"),  # was silently 'off' before
        ("KVARN_KERNELS_TORCH_PLANNER", "2", "0 or 1"),
        ("KVARN_KERNELS_NO_ASM", "on", "0 or 1"),
        ("KVARN_KERNELS_FAST_PREFETCH", "5", "an integer 0..4"),
        ("KVARN_KERNELS_INVARIANT_SPLIT_TILES", "12", "a power of two from 1 to 256"),
        ("KVARN_KERNELS_STAGED_SPLITS", "0", "an integer >= 1"),
        ("KVARN_KERNELS_STORE_WARPS", "7", "4, 8, 16 or 32"),
        ("KVARN_KERNELS_WARMUP_THREADS", "-1", "a positive integer"),
        ("KVARN_KERNELS_ATTN_LAUNCH", "warps=2", "KEY=INT with KEY in"),
    ],
)
def test_a_bad_value_names_the_variable_what_it_accepts_and_what_arrived(
    name: str, bad: str, says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name} must be ") + ".*" + re.escape(says)):
        KernelSettings.from_env({name: bad})
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        KernelSettings.from_env({name: bad})


def test_current_is_read_once_and_reload_rereads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVARN_KERNELS_FAST_PREFETCH", "2")
    assert settings.reload().fast_prefetch == 2
    monkeypatch.setenv("KVARN_KERNELS_FAST_PREFETCH", "3")
    assert settings.current().fast_prefetch == 2  # kept until reloaded
    assert settings.reload().fast_prefetch == 3
    monkeypatch.setenv("KVARN_KERNELS_FAST_PREFETCH", "9")
    with pytest.raises(ValueError, match="KVARN_KERNELS_FAST_PREFETCH"):
        settings.reload()
    assert settings.current().fast_prefetch == 3  # a refused value changes nothing


def test_override_replaces_fields_for_a_block() -> None:
    before = settings.current()
    with settings.override(store_warps=32, autotune=True) as inside:
        assert settings.current() is inside and inside.store_warps == 32 and inside.autotune
    assert settings.current() is before
    with pytest.raises(RuntimeError), settings.override(fast_prefetch=0):
        raise RuntimeError("left early")
    assert settings.current() is before


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.current().autotune = True  # type: ignore[misc]


def test_every_variable_the_sources_name_is_a_setting() -> None:
    """No ``KVARN_KERNELS_*`` variable is read outside the settings object: every such name in
    the package's sources is a field's variable (a gone one is gone from the sources too)."""
    named = set()
    for path in SRC.rglob("*.py"):
        named |= set(re.findall(r"KVARN_KERNELS_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named <= _env_names(), sorted(named - _env_names())
    for path in SRC.rglob("*.py"):
        if path.name != "settings.py":
            assert 'os.environ.get("KVARN' not in path.read_text(), path
