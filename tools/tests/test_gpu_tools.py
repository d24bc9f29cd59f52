"""The GPU machine's set-up scripts in tools/gpu, run here against stand-ins for the machine.

``setup.sh`` is sourced by bash in a scratch copy of the repository layout, with a fake parts
folder (its ``env.sh`` puts a ``python3`` first on PATH that logs its arguments instead of
installing); ``spec_summary.py`` reads a small agreement JSON of e2e_spec.py's shape.
"""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
PACKAGES = ("kvarn-math", "kvarn-kernels", "kvarn-vllm", "kvarn-eval")


def _fake_parts(tmp: Path) -> Path:
    """A parts folder whose env.sh sets KVARN_GPU_FILES and a logging python3 on PATH."""
    parts, bin_dir = tmp / "parts", tmp / "parts" / "bin"
    bin_dir.mkdir(parents=True)
    (parts / "files").mkdir()
    python = bin_dir / "python3"
    python.write_text(
        '#!/usr/bin/env bash\necho "python3 $*" >> "$KVARN_FAKE_LOG"\n'
        'case "$*" in *"import vllm"*) echo 0.26.0 ;; esac\n'
    )
    python.chmod(0o755)
    (parts / "env.sh").write_text(
        f'export PATH="{bin_dir}:$PATH"\nexport KVARN_GPU_FILES="{parts / "files"}"\n'
    )
    return parts


def _source(cwd: Path, parts: Path, tmp: Path) -> tuple[str, list[str]]:
    """Source setup.sh in ``cwd`` under ``set -u``; the shell's output (ending with a line the
    shell prints after the script returned) and the fake python3's calls."""
    log = tmp / "calls.log"
    log.write_text("")
    env = {
        **os.environ,
        "KVARN_GPU_PARTS": str(parts),
        "KVARN_FAKE_LOG": str(log),
        "OUT": str(tmp / "out"),
    }
    env.pop("KVARN_GPU_FILES", None)
    script = f'set -u; source "{GPU / "setup.sh"}"; echo "after: ok=$KVARN_SETUP_OK cwd=$(pwd)"'
    done = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, log.read_text().splitlines()


def _layout(root: Path) -> None:
    for name in PACKAGES:
        (root / name).mkdir(parents=True)


def test_setup_installs_the_checkout_packages(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _layout(repo / "packages")
    out, calls = _source(repo, _fake_parts(tmp_path), tmp_path)
    assert "SETUP FAILED" not in out and f"after: ok=1 cwd={repo}" in out
    (install,) = [c for c in calls if "pip install" in c]
    assert all(f"-e packages/{name}" in install for name in PACKAGES)
    assert "--no-deps" in install and "--no-build-isolation" in install
    assert "setup: vllm 0.26.0" in out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf not found" in out  # no model file carried here


def test_setup_prefers_a_snapshot_and_its_wheels(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _layout(repo / "packages")
    _layout(repo / ".snap" / "packages")
    (repo / ".snap" / "GIT_SHA").write_text("abc1234\n")
    (repo / ".wheels-gpu").mkdir()
    (repo / ".wheels-gpu" / "x-1.0-py3-none-any.whl").write_text("")
    out, calls = _source(repo, _fake_parts(tmp_path), tmp_path)
    assert f"after: ok=1 cwd={repo / '.snap'}" in out and "snapshot abc1234" in out
    assert any(".wheels-gpu/x-1.0-py3-none-any.whl" in c and "--no-index" in c for c in calls)
    (install,) = [c for c in calls if "-e " in c]
    assert "-e .snap/packages/kvarn-vllm" in install


def test_setup_reports_what_is_missing_and_keeps_the_shell(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out, calls = _source(empty, tmp_path / "no-parts", tmp_path)
    # env.sh and the packages; the vLLM import check fails too only where this interpreter
    # lacks vLLM (nox's tests environment has it)
    assert out.count("SETUP FAILED") >= 2
    assert "env.sh is missing" in out and "no packages/ or .snap/packages/" in out
    assert f"after: ok=0 cwd={empty}" in out and calls == []


def test_spec_summary_prints_runs_and_comparisons(tmp_path: Path) -> None:
    spec = {
        "complete": True,
        "runs": {
            "ngram/kvarn_k4v2_g128": {"ok": True, "tokens_per_second": 2470.1, "seconds": 9.5},
        },
        "comparison": {
            "ngram/kvarn_k4v2_g128": {"agreement_with_no_spec": {"tokens": 0.967}, "error": None}
        },
    }
    (tmp_path / "spec_agreement.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(GPU / "spec_summary.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[:2] == ["spec_agreement.json", "complete: True"]
    assert lines[2].startswith("ngram/kvarn_k4v2_g128 True") and "2470.1" in lines[2]
    assert "{'tokens': 0.967}" in lines[3]


@pytest.mark.parametrize("name", ["gemma_prep.py", "spec_summary.py"])
def test_python_tools_compile(name: str, tmp_path: Path) -> None:
    py_compile.compile(str(GPU / name), cfile=str(tmp_path / "out.pyc"), doraise=True)
