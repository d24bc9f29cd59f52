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


# The layout torch.profiler's key_averages().table() prints with CUDA columns (shortened).
_TABLE = """\
-------------------------------------------------------  ------------  ------------  ------------  ------------
Name                                                       Self CPU %     Self CUDA   Self CUDA %    # of Calls
-------------------------------------------------------  ------------  ------------  ------------  ------------
quantize_tiles_kernel                                           0.10%      70.123ms        35.06%          4096
void flash_fwd_kernel<Flash_fwd_kernel_traits<128,...           0.02%     120.000ms        60.00%            32
rotate_rows_kernel                                              0.01%     500.000us         0.25%            64
-------------------------------------------------------  ------------  ------------  ------------  ------------
Self CPU time total: 1.234s
Self CUDA time total: 200.000ms
"""


def test_profiler_table_parses(profile_prefill):
    rows = profile_prefill.parse_profiler_table(_TABLE)
    assert [r["name"] for r in rows] == [
        "quantize_tiles_kernel",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128,...",
        "rotate_rows_kernel",
    ]
    assert rows[0]["self_cuda_us"] == pytest.approx(70123.0)
    assert rows[1]["calls"] == 32 and rows[2]["self_cuda_us"] == pytest.approx(500.0)
    assert len(rows) == 3
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
    assert run["self_cuda_ms_total"] == pytest.approx(190.623)
    assert [r["name"] for r in run["top"]] == ["quantize_tiles_kernel", run["top"][1]["name"]]
    assert run["top"][0]["share"] == pytest.approx(70.123 / 190.623, abs=1e-4)
