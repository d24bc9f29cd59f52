"""Every kernel launch at the supported head sizes compiles for sm_90 within an SM's resources.

Runs on the CPU: Triton compiles for a named target with its own ptxas (``sm90_compile.py``, in a
subprocess because Triton's interpreter has to be off). Catches what the interpreter cannot: a
kernel that needs more shared memory than the GPU has fails only at launch, on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # type: ignore[import-untyped]

HERE = Path(__file__).parent
# sm_90's largest shared memory per block (227 KiB, the "Hardware limit" Triton reports).
SM90_MAX_SHARED = 232448


def _compile(family: str) -> list[dict]:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this Triton wheel ships no ptxas ({ptxas})")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "sm90_compile.py"), family],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return rows


@pytest.mark.parametrize("family", ["store", "dequantize", "attention", "rotation"])
def test_kernels_fit_an_sm90(family: str) -> None:
    rows = _compile(family)
    bad = [r for r in rows if "error" in r or r["shared"] > SM90_MAX_SHARED]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    # Every supported head size was compiled (64, 128 and 256; rotation also 512).
    assert {"64", "128", "256"} <= {r["kernel"].rsplit(" D", 1)[1] for r in rows}


def test_fast_decode_kernel_compiles_for_sm90_at_128_registers() -> None:
    """The Gluon decode kernel (no interpreter exists for Gluon: this is its CPU test besides
    the GPU ones) compiles for every GQA group and frame count the launcher uses, at the
    register cap that gives 4 CTAs per SM, with the batch-invariant launch's fixed splits, and
    with the L2 prefetch of records ahead (``KVARN_KERNELS_FAST_PREFETCH``), whose asm must
    reach the PTX."""
    from kvarn_kernels.attention import fast

    rows = _compile("fast")
    bad = [r for r in rows if "error" in r or r["shared"] > SM90_MAX_SHARED]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    gluon = [r for r in rows if r["kernel"].startswith("fast decode")]
    assert len(gluon) == 8 and len(rows) == 9  # and the query preparation
    assert sum("kvarn_k4v4_g128" in r["kernel"] for r in gluon) == 2
    assert all(r["registers"] <= fast.MAX_REGISTERS for r in gluon), gluon
    # The prefetch asm is not pure, so it survives: one per tile ahead (the prologue's and the
    # loop's), none without it.
    for r in gluon:
        ahead = int(r["kernel"].split(" prefetch ")[1]) if " prefetch " in r["kernel"] else 0
        assert r["l2_prefetches"] == ahead, r
