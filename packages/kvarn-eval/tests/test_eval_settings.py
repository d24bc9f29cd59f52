"""kvarn_eval.settings: the KVARN_* variables kvarn-eval reads, in one object."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import kvarn_eval
from kvarn_eval.settings import EvalSettings


def test_unset_or_blank_is_none_and_values_are_stripped() -> None:
    assert EvalSettings.from_env({}) == EvalSettings()
    got = EvalSettings.from_env({"KVARN_CACHE": " /c ", "KVARN_DATA": "", "KVARN_GIT_SHA": "abc"})
    assert (got.cache, got.data, got.git_sha, got.gpu_files) == ("/c", None, "abc", None)


def test_every_variable_the_package_reads_is_a_setting() -> None:
    """No ``os.environ`` read of a ``KVARN_*`` name in kvarn_eval outside its settings."""
    names = {f.metadata["env"] for f in dataclasses.fields(EvalSettings)}
    for path in Path(kvarn_eval.__file__).parent.rglob("*.py"):
        read = set(re.findall(r"environ(?:\.get)?[\[(]\s*\"(KVARN_[A-Z0-9_]+)", path.read_text()))
        assert not read - names, (path, read - names)
        if path.name != "settings.py":
            assert not read, (path, read)
