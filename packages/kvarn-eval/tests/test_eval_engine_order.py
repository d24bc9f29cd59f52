"""``capacity`` and ``throughput`` together start each engine once, whatever the order typed,
and the dry-run lists them in the order they run (issue 52)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from kvarn_eval import cli, suites
from kvarn_eval.suites import Suite, resolve_suites

FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"
ENGINES = ["--gpu-models", "llama-3.1-8b", "--caches", "bf16@FLASH_ATTN,kvarn_k4v2_g128"]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("capacity,throughput", ["throughput", "capacity"]),
        ("throughput,capacity", ["throughput", "capacity"]),
        ("capacity,kernels,throughput", ["kernels", "throughput", "capacity"]),
        ("capacity", ["capacity"]),
        ("capacity,wikitext", ["capacity", "wikitext"]),
    ],
)
def test_capacity_runs_after_throughput(spec: str, want: list[str]) -> None:
    assert [s.name for s in resolve_suites(spec, gpu=True)] == want


def test_suites_waiting_for_each_other_are_an_error() -> None:
    def run(ctx: object) -> dict[str, object]:
        return {}

    a = Suite("a", "", run, after=("b",))
    b = Suite("b", "", run, after=("a",))
    c = Suite("c", "", run)
    assert suites._run_order([a, c]) == [a, c]
    with pytest.raises(ValueError, match=r"\['a', 'b'\] wait for each other"):
        suites._run_order([a, b, c])


def test_each_engine_starts_once_when_capacity_is_typed_first(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engines run in worker processes that import the stand-in ``vllm``: two caches, two
    engine starts, and ``capacity`` takes both records from ``throughput``'s runs (typed the
    other way round, test_eval_serving's end-to-end test covers it)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setattr(suites, "_gpu_available", lambda: True)
    argv = [
        "bench",
        "--suites",
        "capacity,throughput",
        *ENGINES,
        "--prompt-lens",
        "1024",
        "--output-len",
        "16",
    ]
    assert cli.main([*argv, "--dry-run"]) == 0
    plan = re.findall(r"^  (\w+): ", capsys.readouterr().out, flags=re.MULTILINE)
    assert plan == ["throughput", "capacity"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(": starting (timeout") == 2
    assert printed.count(": capacity from llama-3.1-8b/tp1/") == 2
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["suite"] for r in payload["results"]] == ["throughput", "capacity"]
    assert not (tmp_path / "runs" / "capacity").exists()
    capacity = payload["results"][1]
    assert [r["vs_bf16"] for r in capacity["rows"]] == [1.0, 6.0]
