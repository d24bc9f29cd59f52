"""The benchmark's markdown report and its decode cases (the timing itself needs a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_testing import set_env
from kvarn_kernels import bench


def _report(**fields: Any) -> dict[str, Any]:
    """A report with nothing measured (test GPU, no versions), plus ``fields``."""
    base: dict[str, Any] = {
        "gpu": "test",
        "hbm_copy_gbps": 4000.0,
        "git_sha": "abc",
        "versions": {},
        "attention": [],
        "store": [],
        "notes": [],
    }
    return base | fields


def test_sweep_table_shows_stages_and_error() -> None:
    report = _report(
        sweep=[
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
    )
    text = bench.markdown(report)
    assert "Decode launches (rel. error against SDPA" in text
    assert "| - | llama3-8b | 64 | 16384 | 128 | 4 | 3 | - | 250.0 | 900 | 1.8e-03 |" in text
    assert "| - | hd64 | 64 | 16384 | 64 | 2 | 2 | - | OutOfResources: shared memory | |" in text


def test_verify_sweep_table_names_the_block_and_its_reference() -> None:
    row = {"preset": "kvarn_k4v2_g128", "shape": "llama3-8b", "batch": 64, "context": 16384}
    report = _report(
        sweep=[
            row | {"SUB": 32, "num_warps": 4, "num_stages": 1, "verify_tokens": 16,
                   "time_us": 4235.3, "gbps": 1100.0, "rel_error_vs_decode_rows": 2.5e-3},
        ],
    )  # fmt: skip
    text = bench.markdown(report)
    assert "a verify block of 16 tokens per sequence" in text
    assert (
        "| kvarn_k4v2_g128 | llama3-8b | 64 | 16384 | 32 | 4 | 1 | - | 4235.3 | 1100 | 2.5e-03 |"
        in text
    )


def test_report_header_names_the_launch_settings_of_the_environment() -> None:
    report = _report(launch_env={"KVARN_KERNELS_STAGED_SPLITS": "1"})
    header = bench.markdown(report).splitlines()[0]
    assert header.endswith("; KVARN_KERNELS_STAGED_SPLITS=1")
    del report["launch_env"]
    assert "KVARN_KERNELS" not in bench.markdown(report)


def test_git_sha_from_the_environment(monkeypatch) -> None:
    set_env(monkeypatch, "KVARN_GIT_SHA", "f8c4936")
    assert bench._git_sha() == "f8c4936"


@pytest.mark.parametrize("windows", bench.WINDOWS)
def test_decode_case_with_each_window_layout_matches_its_reference(windows: str) -> None:
    """The bench's decode case, in Triton's interpreter, with the staging of each window layout
    (sink and recent tile exact, keys too or values only): the kernel matches SDPA over the
    records with the staged rows put in, and a reference that takes the wrong rows does not
    (so the check can fail)."""
    cpu = torch.device("cpu")
    preset, d, hkv = "kvarn_k4v2_g128", 64, 2
    template = bench._template_records(preset, d, hkv, torch.bfloat16, cpu, mixed=True)
    case = bench._Case(preset, 4, hkv, d, 1, 256, torch.bfloat16, cpu, template, True, windows)
    assert bench._check_against_dequantized(case) < 1e-2
    if windows == "open":
        return
    right = case.staged_kv

    def wrong_rows() -> tuple[torch.Tensor, ...]:
        k, v, from_keys, from_values = right()
        # the windows' keys from the other place: values-only windows read as if their keys
        # were staged, keys-too windows as if every key came from the records
        wrong = from_values if windows == "values" else torch.zeros_like(from_keys)
        return k, v, wrong, from_values

    case.staged_kv = wrong_rows  # type: ignore[method-assign]
    assert bench._check_against_dequantized(case) > 0.2


def test_window_layouts_read_what_they_stage() -> None:
    cpu = torch.device("cpu")
    preset, d, hkv, g = "kvarn_k4v2_g128", 64, 2, 128
    template = bench._template_records(preset, d, hkv, torch.bfloat16, cpu)
    cases = {
        w: bench._Case(preset, 4, hkv, d, 3, 4 * g, torch.bfloat16, cpu, template, False, w)
        for w in bench.WINDOWS
    }
    assert cases["open"].staging.shape == (3, 2, g, hkv, d)
    assert cases["keys"].staging.shape == (3, 2, 3 * g, hkv, d)  # sink rows, 2-tile ring
    assert cases["values"].staging.shape == (3, g + 3 * g, hkv, d)  # key ring, value rows
    assert cases["keys"].qlens.tolist() == [3 * g] * 3  # the recent tile read from staging
    assert cases["values"].key_lens.tolist() == [4 * g] * 3  # its keys from the records
    # bytes read: keys staging 2 tiles more than values, which read 2 more records (whole)
    tile = cases["open"].layout.tile_bytes
    diff = cases["keys"].bytes_quantized() - cases["values"].bytes_quantized()
    assert diff == 3 * hkv * (2 * g * d * 2 - 2 * tile)
    with pytest.raises(ValueError, match="windows must be one of"):
        bench._Case(preset, 4, hkv, d, 1, 2 * g, torch.bfloat16, cpu, template, False, "sink")
    with pytest.raises(ValueError, match="needs a context of 2 tiles"):
        bench._Case(preset, 4, hkv, d, 1, g, torch.bfloat16, cpu, template, False, "keys")


def test_store_variants_table_shows_the_speculative_commit_step() -> None:
    """Rows of ``auto`` key frames carry the speculative commit step with and without frame
    queries; rotated rows have none and print a dash."""
    common = {"preset": "kvarn_k4v2_g128", "shape": "llama3-8b", "iterations": 2}
    times = {
        "store_step_typical_ms": 0.010,
        "store_step_worst_ms": 0.030,
        "store_prefill_ms": 0.200,
        "store_prefill_per_tile_us": 0.39,
    }
    report = _report(
        store_sweep=[
            {**common, **times, "key_frame": "rotated", "warps": "default"},
            {
                **common,
                **times,
                "key_frame": "auto",
                "warps": "default",
                "store_step_commit_ms": 0.0251,
                "store_step_commit_frame_queries_ms": 0.0262,
            },
        ],
    )
    text = bench.markdown(report)
    assert "| rotated | 2 | default | 10.0 | 30.0 | 200.0 | 0.39 | - | - |" in text
    assert "| auto | 2 | default | 10.0 | 30.0 | 200.0 | 0.39 | 25.1 | 26.2 |" in text


def test_verify_table_compares_the_two_verify_launches() -> None:
    """``--verify K`` rows: the decode step, the verify block through the multi-query kernel
    and as decode rows, and their ratio."""
    row = {
        "preset": "kvarn_k4v2_g128",
        "shape": "llama3-8b",
        "batch": 64,
        "context": 16384,
        "time_us": 600.0,
        "gbps": 3000.0,
        "hbm_fraction": 0.75,
        "num_splits": 1,
        "verify_multi_query_us": 800.0,
        "verify_as_decode_us": 2000.0,
        "verify_tokens": 5,
        "verify_rel_diff": 1.5e-3,
        "verify_differing": 0.125,
    }
    text = bench.markdown(_report(attention=[row]))
    assert "Speculative verify step, 5 tokens per sequence:" in text
    want = "| kvarn_k4v2_g128 | llama3-8b | 64 | 16384 | 600.0 | 800.0 | 2000.0 | 2.50x | 1.5e-03 | 12.5% |"
    assert want in text


@pytest.mark.parametrize("raw", ["-1", "16"])
def test_verify_drafts_out_of_range_are_refused(raw: str) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--out", "/tmp/x.json", "--dry-run", "--verify", raw])


@pytest.mark.parametrize("windows", bench.WINDOWS)
def test_verify_case_launches_compute_the_same_attention(windows: str) -> None:
    """The bench's verify step in Triton's interpreter: the multi-query launch with the block's
    staged tokens as its own K/V and the block as decode rows give the same attention up to
    rounding, for each window layout (so the bench times two ways of one computation); with
    other own K/V the multi-query launch is far off (the check can fail). The queries come from
    torch's global generator: seeded, so that a run does not depend on the tests before it."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    preset, d, hkv = "kvarn_k4v2_g128", 64, 2
    template = bench._template_records(preset, d, hkv, torch.bfloat16, cpu, mixed=True)
    case = bench._Case(preset, 4, hkv, d, 2, 256, torch.bfloat16, cpu, template, True, windows)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    as_decode = case.verify(1, True).clone()
    # bf16 rounding of a few elements (unseeded runs ranged up to 1.9e-4)
    assert rel(case.verify(1, False), as_decode) < 1e-3
    case.v_own = (case.v_own[0].flip(0).contiguous(), case.v_own[1])
    assert rel(case.verify(1, False), as_decode) > 1e-2


def test_verify_sweep_needs_a_verify_block(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--out", "/tmp/x.json", "--dry-run", "--sweep", "verify"])
    assert "give --verify K" in capsys.readouterr().err


def test_verify_sweep_times_each_launch_and_restores_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--sweep verify`` in Triton's interpreter: each multi-query launch computes the verify
    block's attention (close to the block as decode rows; a launch that broke the kernel
    would not be), and the engine's default launch is back afterwards."""
    from kvarn_kernels.attention import launch

    torch.manual_seed(0)
    monkeypatch.setattr(bench, "_MQ_LAUNCHES", ((64, 4), (32, 4)))
    before = launch.default_launch
    rows = bench._sweep(
        "kvarn_k4v2_g128", torch.bfloat16, torch.device("cpu"), True, 3, "auto", "values"
    )
    assert launch.default_launch is before
    assert [(r["SUB"], r["num_warps"]) for r in rows] == [(64, 4), (32, 4)]
    for r in rows:
        assert "error" not in r, r
        assert r["verify_tokens"] == 4 and r["time_us"] > 0
        assert r["rel_error_vs_decode_rows"] < 1e-2
