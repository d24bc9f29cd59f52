"""Attention as plan and run: the same bits as decode_attention and multi_query_attention."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kernel_testing import build_paged
from kvarn_kernels.attention.wrapper import plan_attention
from kvarn_math import get_preset
from kvarn_math.testing import make_kv

pytestmark = pytest.mark.interpreter

PRESET = "kvarn_k4v2_g128"
HKV, GROUP, D = 2, 2, 128


def _batch(lens: list[int], sinks: list[bool] | None = None, data_seed: int = 0):
    """A paged cache of sequences of ``lens`` tokens; the block table and slots depend on
    ``lens`` only, the records on ``data_seed`` too (layers of one step)."""
    seqs = [
        (
            make_kv((t, HKV, D), "outlier_channels", data_seed + 2 * i),
            make_kv((t, HKV, D), "gaussian", data_seed + 2 * i + 1),
        )
        for i, t in enumerate(lens)
    ]
    return build_paged(seqs, PRESET, torch.float16, "cpu", sinks=sinks)


def test_decode_plan_runs_decode_attention() -> None:
    """Two layers' caches under one plan: each run equals decode_attention's bits for it."""
    layers = [_batch([130, 5, 257], [True, False, True], data_seed=100 * i) for i in range(2)]
    b = layers[0]
    plan = plan_attention(
        b.block_table, b.seq_lens, b.quantized_lens, b.staging_slots, PRESET, D**-0.5,
        sink_lens=b.sink_lens, sliding_window=200,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    assert not torch.equal(layers[0].kv_cache, layers[1].kv_cache)
    for layer in layers:
        assert torch.equal(layer.block_table, b.block_table)  # one step: the same tables
        assert torch.equal(layer.staging_slots, b.staging_slots)
        q = torch.randn(3, HKV * GROUP, D, generator=gen).half()
        want = kk.decode_attention(
            q, layer.kv_cache, layer.staging, b.block_table, b.seq_lens, b.quantized_lens,
            b.staging_slots, PRESET, D**-0.5, sliding_window=200, sink_lens=b.sink_lens,
        )  # fmt: skip
        out = torch.full_like(q, float("nan"))
        got = plan.run(q, layer.kv_cache, layer.staging, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, want)


def test_multi_query_plan_runs_multi_query_attention() -> None:
    """A plan of several query tokens per sequence reads ``max_query_len`` once and runs
    multi_query_attention, with the layer's own K/V where given."""
    b = _batch([140, 60])
    qlens = [12, 3]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    plan = plan_attention(
        b.block_table, b.seq_lens, b.quantized_lens, b.staging_slots, get_preset(PRESET),
        D**-0.5, query_start_loc=qsl,
    )  # fmt: skip
    assert plan.max_query_len == 12 and plan.num_seqs == 2
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(15, HKV * GROUP, D, generator=gen).half()
    own = tuple(torch.randn(15, HKV, D, generator=gen).half() for _ in range(2))
    for fresh in (None, own):
        want = kk.multi_query_attention(
            q, qsl, b.kv_cache, b.staging, b.block_table, b.seq_lens, b.quantized_lens,
            b.staging_slots, PRESET, D**-0.5, max_query_len=12, fresh_kv=fresh,
        )  # fmt: skip
        assert torch.equal(plan.run(q, b.kv_cache, b.staging, fresh_kv=fresh), want)


def test_plan_errors_name_the_argument() -> None:
    b = _batch([10])
    args = (b.block_table, b.seq_lens, b.quantized_lens, b.staging_slots, PRESET, 0.1)
    with pytest.raises(ValueError, match="quantized_lens must be an int32 tensor"):
        plan_attention(*args[:2], b.quantized_lens.long(), *args[3:])
    with pytest.raises(ValueError, match="staging_slots must have 1 entries"):
        plan_attention(*args[:3], torch.zeros(2, dtype=torch.int32), *args[4:])
    with pytest.raises(ValueError, match="block_table must be int32"):
        plan_attention(b.block_table[0], *args[1:])
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        plan_attention(*args, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    plan = plan_attention(*args)
    q = torch.zeros(1, HKV * GROUP, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="fresh_kv is for plans of several query tokens"):
        plan.run(q, b.kv_cache, b.staging, fresh_kv=(q, q))
