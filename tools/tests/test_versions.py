"""Each package writes its version once (``__version__``; hatch reads it into the metadata), its
changelog's newest release is that version, and its siblings' version ranges admit it."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import tomllib

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
NAMES = ("kvarn-math", "kvarn-kernels", "kvarn-vllm", "kvarn-eval")


def _version(name: str) -> str:
    init = PACKAGES / name / "src" / name.replace("-", "_") / "__init__.py"
    (found,) = re.findall(r'^__version__ = "([^"]+)"$', init.read_text(), re.M)
    return found


def _pyproject(name: str) -> dict:
    return tomllib.loads((PACKAGES / name / "pyproject.toml").read_text())


def _parts(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.match(r"[\d.]+", version).group().strip(".").split("."))


@pytest.mark.parametrize("name", NAMES)
def test_the_version_is_written_once(name: str) -> None:
    meta = _pyproject(name)
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    module = name.replace("-", "_")
    assert meta["tool"]["hatch"]["version"]["path"] == f"src/{module}/__init__.py"
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return  # not installed here: nothing else can disagree
    assert installed == _version(name)


@pytest.mark.parametrize("name", NAMES)
def test_the_changelog_leads_with_this_version(name: str) -> None:
    text = (PACKAGES / name / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", text, re.M)
    assert first and first.group(1) == _version(name), (name, first and first.group(1))
    for heading in re.findall(r"^### (.+)$", text, re.M):
        assert heading in ("Added", "Changed", "Fixed", "Removed", "Deprecated", "Security")


@pytest.mark.parametrize("name", NAMES)
def test_sibling_ranges_admit_the_siblings(name: str) -> None:
    for dep in _pyproject(name)["project"]["dependencies"]:
        sibling = re.match(r"(kvarn-[a-z]+)", dep)
        if not sibling:
            continue
        have = _parts(_version(sibling.group(1)))
        for op, bound in re.findall(r"(>=|<)([\d.]+)", dep):
            ok = have >= _parts(bound) if op == ">=" else have < _parts(bound)
            assert ok, f"{name} requires {dep}, {sibling.group(1)} is {'.'.join(map(str, have))}"
