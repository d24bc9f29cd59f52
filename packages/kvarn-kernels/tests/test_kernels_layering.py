"""Import hygiene (no CUDA initialization, no vLLM) and signature agreement with kvarn-math."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvarn_kernels
import kvarn_math
import pytest


def test_import_does_not_initialize_cuda_or_import_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvarn_kernels, kvarn_kernels.bench
        import torch
        assert not torch.cuda.is_initialized(), "importing kvarn_kernels initialized CUDA"
        bad = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not bad, f"kvarn_kernels imported {bad}"
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_only_the_benchmark_imports_vllm_and_only_lazily() -> None:
    """vLLM appears only as the benchmark's optional baseline, imported inside a function."""
    from pathlib import Path

    root = Path(kvarn_kernels.__file__).parent
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            if "import vllm" in line or "from vllm" in line:
                assert path.name == "bench.py", path
                assert line.startswith(" "), f"module-level vLLM import in {path}: {line}"


@pytest.mark.parametrize(
    "name",
    ["quantize_tiles", "encode_tiles", "decode_tiles", "dequantize_tiles", "rotate", "unrotate"],
)
def test_signatures_match_kvarn_math(name: str) -> None:
    ours = inspect.signature(getattr(kvarn_kernels, name))
    ref = inspect.signature(getattr(kvarn_math, name))
    names, ref_names = list(ours.parameters), list(ref.parameters)
    # Same names in the same order; the kernel may only add trailing arguments with defaults.
    assert names[: len(ref_names)] == ref_names, (name, ours, ref)
    for extra in names[len(ref_names) :]:
        assert ours.parameters[extra].default is not inspect.Parameter.empty, (name, extra)
    for p_name, p in ref.parameters.items():
        assert ours.parameters[p_name].default == p.default or p.default is None, p_name


def test_public_api_is_exported() -> None:
    for name in kvarn_kernels.__all__:
        assert hasattr(kvarn_kernels, name), name


def test_cpu_tensors_without_the_interpreter_are_refused() -> None:
    code = textwrap.dedent(
        """
        import torch, kvarn_kernels
        try:
            kvarn_kernels.rotate(torch.zeros(2, 64))
        except ValueError as exc:
            assert "CUDA device" in str(exc), exc
            print("ok")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_kernels_implement_kvarn_maths_format_version() -> None:
    assert kvarn_kernels.FORMAT_VERSION == kvarn_math.FORMAT_VERSION
    kvarn_kernels.check_format_version(kvarn_math.FORMAT_VERSION)
    with pytest.raises(
        ImportError, match="implements cache format 3, but the installed kvarn-math"
    ):
        kvarn_kernels.check_format_version(2)


def test_compile_cache_redirects_triton_and_puts_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM points TRITON_CACHE_DIR at a folder per engine configuration; compiles inside
    ``compile_cache`` go to one stable folder instead, and the engine's setting comes back
    afterwards (also when the block raises). An unwritable folder changes nothing."""
    import triton  # type: ignore[import-untyped]

    engine_dir = str(tmp_path / "engine")
    monkeypatch.setenv("TRITON_CACHE_DIR", engine_dir)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    with kvarn_kernels.compile_cache() as used:
        assert used == str(tmp_path / "home" / ".triton" / "cache")
        assert triton.knobs.cache.dir == used and os.environ["TRITON_CACHE_DIR"] == used
    assert os.environ["TRITON_CACHE_DIR"] == engine_dir == triton.knobs.cache.dir
    stable = tmp_path / "stable"
    with pytest.raises(RuntimeError), kvarn_kernels.compile_cache(str(stable)) as used:
        assert used == str(stable) and stable.is_dir()
        raise RuntimeError("a failed compile")
    assert os.environ["TRITON_CACHE_DIR"] == engine_dir == triton.knobs.cache.dir
    blocker = tmp_path / "file"
    blocker.write_text("")
    with kvarn_kernels.compile_cache(str(blocker / "cache")) as used:  # cannot be created
        assert used is None and triton.knobs.cache.dir == engine_dir
