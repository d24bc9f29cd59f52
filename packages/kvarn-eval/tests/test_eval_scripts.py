"""The research scripts' own helpers (the scripts themselves need a model and minutes)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def recipe_sweep():
    spec = importlib.util.spec_from_file_location("recipe_sweep", SCRIPTS / "recipe_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
