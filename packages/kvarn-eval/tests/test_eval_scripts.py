"""The research scripts' own helpers (the scripts themselves need a model and minutes)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str):
    """Import ``scripts/<name>.py`` as a module (the scripts are not installed)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe_sweep():
    return _load_script("recipe_sweep")


@pytest.mark.parametrize("bits", [2, 4])
def test_refit_never_grows_the_error_and_keeps_codes_in_range(recipe_sweep, bits):
    from kvarn_math.rtn import dequantize_rows, quantize_rows

    rng = np.random.default_rng(bits)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:4] = 3.0  # constant rows: no grid to refit, left as RTN made them
    q = quantize_rows(x, bits)
    errors = [np.mean((dequantize_rows(q) - x) ** 2)]
    for iters in (1, 2, 4):
        r = recipe_sweep.refit(q, x, iters)
        assert r.codes.max() < 2**bits and r.bits == bits
        errors.append(np.mean((dequantize_rows(r) - x) ** 2))
        np.testing.assert_array_equal(r.step[:4], q.step[:4])
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(errors))
    assert errors[-1] < (0.7 if bits == 2 else 1.0) * errors[0]


@pytest.fixture(scope="module")
def profile_prefill():
    return _load_script("profile_prefill")


# Lines of a real table: vLLM 0.26's torch profiler on an H200 (2026-11-30, bf16, 16K prefill).
_TABLE = (Path(__file__).parent / "data" / "profiler_table_h200.txt").read_text()


def test_profiler_table_parses(profile_prefill):
    rows = profile_prefill.parse_profiler_table(_TABLE)
    assert [r["name"] for r in rows] == [
        "execute_context_1(16384)_generation_0(0)",
        "aten::mm",
        "_vllm_fa3_C::fwd",
        "void cutlass::device_kernel<flash::enable_sm90_or_la...",
        "cudaEventSynchronize",
    ]
    assert rows[1]["self_cuda_us"] == pytest.approx(1.299e6)
    assert rows[1]["calls"] == 516 and rows[3]["self_cuda_us"] == pytest.approx(507369.0)
    assert rows[4]["self_cuda_us"] == 0.0 and rows[4]["calls"] == 4
    assert profile_prefill.parse_cuda_total_us(_TABLE) == pytest.approx(1.933e6)
    assert profile_prefill.parse_cuda_total_us("no footer") is None
    assert profile_prefill.parse_time_us("1.5s") == pytest.approx(1.5e6)
    with pytest.raises(ValueError, match="not a profiler time"):
        profile_prefill.parse_time_us("12 parsecs")
    with pytest.raises(ValueError, match="Self CUDA"):
        profile_prefill.parse_profiler_table("Name  Self CPU\n----  --------\n")


def test_profile_summary_names_a_missing_table(profile_prefill, tmp_path):
    run = profile_prefill.summarize(tmp_path, {"generate_seconds": 1.0})
    assert "no profiler_out" in run["error"]
    (tmp_path / "profiler_out_0.txt").write_text(_TABLE)
    run = profile_prefill.summarize(tmp_path, {"generate_seconds": 1.0}, top=2)
    assert run["self_cuda_ms_total"] == pytest.approx(1933.0)  # the footer, not the rows' sum
    assert [r["name"] for r in run["top"]] == [
        "execute_context_1(16384)_generation_0(0)",
        "aten::mm",
    ]
    assert run["top"][1]["share"] == pytest.approx(1299.0 / 1933.0, abs=1e-4)
    (tmp_path / "profiler_out_0.txt").write_text(_TABLE.replace("Self CUDA time total", "x"))
    run = profile_prefill.summarize(tmp_path, {"generate_seconds": 1.0})
    assert run["self_cuda_ms_total"] == pytest.approx(1942.0 + 1299.0 + 507.369 * 2, abs=0.01)
