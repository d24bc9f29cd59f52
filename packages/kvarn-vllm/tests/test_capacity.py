"""The capacity arithmetic (kvarn_vllm.capacity) against what the plugin really allocates and
against the capacity measured on the H200."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from kvarn_math.layout import PRESETS
from kvarn_vllm import capacity, dense, staging
from kvarn_vllm.capacity import (
    BUDGETS,
    LLAMA_3_1_8B,
    ModelShape,
    default_config,
    project,
    staging_breakdown,
)

SMALL = ModelShape("small", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


def _allocated_per_slot(config, shape: ModelShape, slots: int = 3) -> int:
    """Bytes ``allocate_layer_staging`` allocates per slot for one layer of ``shape`` on the
    CPU (staging and frame queries), the process's staging report restored afterwards."""
    saved = dict(staging._STAGING)
    try:
        staging._STAGING.update(bytes=0, layers=0, frame_query_bytes=0)
        stage, fq = staging.allocate_layer_staging(
            config, slots, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            torch.bfloat16, torch.device("cpu"),
        )  # fmt: skip
        reported = staging._STAGING["bytes"]
    finally:
        staging._STAGING.clear()
        staging._STAGING.update(saved)
    real = stage.numel() * stage.element_size()
    if fq is not None:
        real += fq.numel() * fq.element_size()
    assert real == reported
    return real // slots


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"window_keys": True},
        {"window_keys": False},
        {"recent_tiles": 0, "sink": False},
        {"recent_tiles": 2, "sink": False},
        {"staging_tiles": 2, "key_frame": "auto"},  # speculative decoding: frame queries
        {"staging_tiles": 2, "key_frame": "auto", "window_keys": True},
    ],
)
def test_breakdown_is_what_the_plugin_allocates(name, settings):
    config = default_config(name, **settings)
    parts = staging_breakdown(config, SMALL)
    assert sum(parts.values()) == _allocated_per_slot(config, SMALL)
    assert (parts["frame_queries"] > 0) is config.frame_queries


def test_llama_breakdown_matches_the_logged_staging():
    """The H200 runs logged 8 GiB at 256 slots for the 4-bit-key presets at G=128 and 12 GiB
    for the 2- and 3-bit-key ones (thirty-fifth run): 32 and 48 MiB per slot."""
    mib = {
        name: sum(staging_breakdown(default_config(name), LLAMA_3_1_8B).values()) / 2**20
        for name in PRESETS
    }
    assert mib["kvarn_k4v2_g128"] == mib["kvarn_k4v4_g128"] == 32
    assert mib["kvarn_k4v2_g64"] == 16
    assert mib["kvarn_k2v2_g128"] == mib["kvarn_k3v2_g128"] == 48
    # half of the 4-bit presets' staging is the exact windows (sink and recent values)
    parts = staging_breakdown(default_config("kvarn_k4v2_g128"), LLAMA_3_1_8B)
    assert parts["sink_values"] + parts["recent_values"] == 16 * 2**20


def test_fp8_windows_halve_only_the_windows():
    config = default_config("kvarn_k2v2_g128")  # windows keep keys and values
    bf16 = staging_breakdown(config, LLAMA_3_1_8B)
    fp8 = staging_breakdown(config, LLAMA_3_1_8B, window_dtype_bytes=1)
    assert staging_breakdown(config, LLAMA_3_1_8B, window_dtype_bytes=2) == bf16
    for part, size in bf16.items():
        assert fp8[part] == (size // 2 if part.startswith(("recent", "sink")) else size)


@pytest.mark.parametrize("max_model_len", [0, 256, 5376, 131072])
def test_workspace_is_what_dense_allocates(max_model_len):
    shape = ModelShape("ws", num_layers=1, num_heads=4, num_kv_heads=3, head_dim=64)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=max_model_len)
    )
    dense._WORKSPACES.clear()
    try:
        ws = dense.dense_workspace(3, 64, vllm_config, torch.device("meta"))
        assert capacity.DENSE_CONTEXT_WORKSPACE_BYTES == dense.DENSE_CONTEXT_WORKSPACE_BYTES
        assert capacity.dense_workspace_bytes(shape, max_model_len) == ws.numel() * 2
    finally:
        dense._WORKSPACES.clear()


# Thirty-fifth H200 run (docs/results/h200-2026-12-05): Llama-3.1-8B shape, 256 slots,
# gpu_memory_utilization 0.9, max_model_len 5,376, eager; KV cache tokens vLLM logged.
H200_MEASURED = {
    "kvarn_k4v2_g128": 3_983_360,
    "kvarn_k4v4_g128": 3_060_608,
    "kvarn_k4v2_g64": 3_950_720,
    "kvarn_k4v4_g64": 3_068_224,
    "kvarn_k2v2_g128": 5_476_736,
    "kvarn_k3v2_g128": 4_504_448,
}


@pytest.mark.parametrize("name", sorted(H200_MEASURED))
def test_projection_reproduces_the_h200_measurement(name):
    h200 = next(b for b in BUDGETS if b.name.startswith("H200"))
    p = project(default_config(name), LLAMA_3_1_8B, h200, slots=256)
    assert p.kvarn_tokens == pytest.approx(H200_MEASURED[name], rel=1e-3)
    assert p.bf16_tokens == pytest.approx(891_872, rel=1e-3)  # bf16@FLASH_ATTN, same run


def test_projection_accounting():
    budget = BUDGETS[0]
    config = default_config("kvarn_k4v2_g128")
    p = project(config, LLAMA_3_1_8B, budget, slots=256)
    assert p.byte_limit == pytest.approx(512 / 106.125)
    # a per-live pool with every slot running holds what the fixed reservation does, up to
    # each slot's block rounding
    g = config.preset.group_size
    assert abs(p.live_vs_bf16(256) - p.vs_bf16) * p.bf16_tokens <= 256 * g + g
    assert p.live_vs_bf16(0) > p.vs_bf16
    # fewer slots, more tokens; none past the budget
    assert project(config, LLAMA_3_1_8B, budget, slots=64).kvarn_tokens > p.kvarn_tokens
    tiny = replace(budget, utilization=0.25)
    assert project(config, LLAMA_3_1_8B, tiny, slots=256).kvarn_tokens == 0
    n = p.running_within(0.97)
    assert p.live_vs_bf16(n) / p.byte_limit >= 0.97 > p.live_vs_bf16(n + 1) / p.byte_limit
    # a pool filled with 16K-token requests: as many as their records and staging fit
    running, share = p.filled(16384)
    assert running * (16384 + p.slot_tokens) <= p.pool_tokens
    assert (running + 1) * (16384 + p.slot_tokens) > p.pool_tokens
    assert share == p.live_vs_bf16(running)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        project(config, LLAMA_3_1_8B, budget, slots=0)


def test_main_prints_a_row_per_budget_and_preset(capsys):
    assert capacity.main(["--slots", "128"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| H", "| 24"))]
    assert len(rows) == len(BUDGETS) * len(PRESETS)
    assert "128 slots" in out
