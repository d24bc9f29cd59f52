"""The host-cost script (scripts/host_cost.py), run small on the CPU in a subprocess (it sets
Triton's interpreter and vLLM's CPU platform for itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _releases

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host_cost.py"


def test_host_cost_counts_what_a_mixed_step_launches(tmp_path):
    """A mixed n-gram step's verify blocks join the decode rows: a layer launches what a
    decode step does (the store's two kernels, attention and its combine) and makes as many
    torch calls, where a uniform verify step expands its blocks inside the layer."""
    out = tmp_path / "host.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    args = ["--requests", "6", "--layers", "2", "--steps", "2", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| mixed |" in proc.stdout and "| decode |" in proc.stdout
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["mixed"]["launches_per_layer"] == rows["decode"]["launches_per_layer"] == 4
    assert rows["mixed"]["torch_calls_per_layer"] == rows["decode"]["torch_calls_per_layer"]
    assert rows["uniform"]["torch_calls_per_layer"] > rows["decode"]["torch_calls_per_layer"]
    assert all(r["forward_us_per_layer"] > 0 and r["build_ms"] > 0 for r in rows.values())


def test_host_cost_refuses_bad_sizes():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--requests: must be >= 1" in proc.stderr


# speculative steps, served on vLLM 0.26: where the 'draft-steps' ledger entry applies
pytestmark = _releases.needs("draft-steps")
