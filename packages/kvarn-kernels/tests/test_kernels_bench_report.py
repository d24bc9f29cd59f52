"""The benchmark's markdown report (the timing itself needs a GPU)."""

from __future__ import annotations

from kvarn_kernels import bench


def test_sweep_table_shows_stages_and_error() -> None:
    report = {
        "gpu": "test",
        "hbm_copy_gbps": 4000.0,
        "git_sha": "abc",
        "versions": {},
        "attention": [],
        "store": [],
        "notes": [],
        "sweep": [
            {
                "shape": "llama3-8b",
                "batch": 64,
                "context": 16384,
                "SUB": 128,
                "num_warps": 4,
                "num_stages": 3,
                "time_us": 250.0,
                "gbps": 900.0,
                "rel_error_vs_dequantized_sdpa": 1.8e-3,
            },
            {
                "shape": "hd64",
                "batch": 64,
                "context": 16384,
                "SUB": 64,
                "num_warps": 2,
                "num_stages": 2,
                "error": "OutOfResources: shared memory",
            },
        ],
    }
    text = bench.markdown(report)
    assert "| llama3-8b | 64 | 16384 | 128 | 4 | 3 | - | 250.0 | 900 | 1.8e-03 |" in text
    assert "| hd64 | 64 | 16384 | 64 | 2 | 2 | - | OutOfResources: shared memory | |" in text


def test_git_sha_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVARN_GIT_SHA", "f8c4936")
    assert bench._git_sha() == "f8c4936"
