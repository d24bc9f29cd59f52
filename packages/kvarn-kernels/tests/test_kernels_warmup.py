"""warmup(): every kernel variant compiled before serving (CPU: it runs; GPU: nothing compiles after)."""

from __future__ import annotations

import kvarn_kernels as kk
import numpy as np
import pytest
import torch
from kvarn_kernels.attention.launch import _query_block, query_block_sizes


@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
def test_query_block_sizes_cover_every_query_length(group: int) -> None:
    sizes = query_block_sizes(group)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    for n in range(1, 300):
        assert _query_block(n, group, False) in sizes, n
    assert len(sizes) == 1 + int(np.log2(max(1, 64 // (1 << (group - 1).bit_length()))))


def test_query_block_sizes_batch_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVARN_KERNELS_BATCH_INVARIANT", "1")
    assert query_block_sizes(4) == [4]  # 16 rows, as a decode block
    assert query_block_sizes(16) == [1]


@pytest.mark.interpreter
@pytest.mark.parametrize(("sink", "window"), [(False, None), (True, 40)])
def test_warmup_runs_every_path(sink: bool, window: int | None) -> None:
    summary = kk.warmup(
        "kvarn_k4v4_g64", 64, 4, 2, torch.float32, "cpu", sink=sink, sliding_window=window
    )
    paths = 1 + int(window is not None)  # unmasked and windowed
    assert summary["query_block_sizes"] == [1, 2, 4, 8, 16, 32]
    assert summary["launches"] == 2 + paths * 2 * (1 + 2 * 6) + 3  # MQA with and without fresh_kv
    only = kk.warmup(
        "kvarn_k4v4_g64", 64, 4, 2, torch.float32, "cpu", own_kv=(True,), key_frame="auto"
    )
    assert only["launches"] == 2 + 2 * (1 + 6) + 3
    assert summary["seconds"] > 0
    assert kk.compiled_variants() == {}  # the interpreter compiles nothing


@pytest.mark.interpreter
def test_warmup_with_values_only_windows() -> None:
    """The values-only layout (a 4-D staging area, the key ring of the open tile apart)."""
    summary = kk.warmup(
        "kvarn_k4v2_g64", 64, 4, 2, torch.float32, "cpu", staging_tiles=2, sink=True, key_tiles=1
    )
    assert summary["launches"] == 2 + 2 * (1 + 2 * 6) + 3


def test_warmup_rejects_a_bad_head_split() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kk.warmup("kvarn_k4v2_g128", 128, 6, 4, torch.float16, "cpu")
    with pytest.raises(ValueError, match="kvarn_k9"):
        kk.warmup("kvarn_k9v9_g1", 128, 8, 8, torch.float16, "cpu")
    with pytest.raises(ValueError, match="key_frame must be one of"):
        kk.warmup("kvarn_k4v2_g128", 128, 8, 8, torch.float16, "cpu", key_frame="raw")


@pytest.mark.gpu
@pytest.mark.parametrize("sink", [False, True])
def test_nothing_compiles_after_warmup(sink: bool) -> None:
    """After warmup, serving-like calls of every size (batch, query length, window, rows)
    launch only kernels already compiled (the store choosing key frames, attention reading
    them: kvarn-vllm's default)."""
    preset, d, hq, hkv, dtype, dev = "kvarn_k4v2_g128", 128, 32, 8, torch.bfloat16, "cuda"
    kk.warmup(preset, d, hq, hkv, dtype, dev, sink=sink, sliding_window=700, key_frame="auto")
    before = kk.compiled_variants()
    assert before and all(n >= 1 for n in before.values()), before
    g = 128
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch, max_blocks = 37, 21  # neither 1 nor a multiple of 16
    cache = kk.allocate_cache(batch * max_blocks + 1, hkv, d, preset, dev)
    staging = kk.allocate_staging(batch, hkv, d, preset, dtype, dev, sink=sink)
    lens_host = np.array([1 + (i * 997) % (max_blocks * g - 1) for i in range(batch)])
    table_host = np.arange(1, batch * max_blocks + 1, dtype=np.int32).reshape(batch, max_blocks)
    for chunk in (1, 17, 160):  # stage writes of 1, 17 and 160 rows per request
        cached = np.maximum(lens_host - chunk, 0)
        new = lens_host - cached
        total = int(new.sum())
        k = torch.randn((total, hkv, d), generator=gen).to(dev, dtype)
        q = torch.randn((total, hq, d), generator=gen).to(dev, dtype)
        plan = kk.plan_store(cached, new, None, np.arange(batch), table_host, preset, sink=sink)
        kk.store_kv(k, k.clone(), cache, staging, plan.to(dev), preset, key_frame="auto", query=q)
    table = torch.as_tensor(table_host, device=dev)
    lens = torch.as_tensor(lens_host, dtype=torch.int32, device=dev)
    quant = (lens // g) * g
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    sink_lens = torch.where(lens >= g, g, 0).to(torch.int32) if sink else None
    sink_slots = slots if sink else None
    for b in (1, 5, 16, 37):
        for window in (None, 700, 33):
            q = torch.randn((b, hq, d), generator=gen).to(dev, dtype)
            kk.decode_attention(
                q, cache, staging, table[:b], lens[:b], quant[:b], slots[:b], preset, d**-0.5,
                sliding_window=window, sink_lens=None if not sink else sink_lens[:b],
                sink_slots=None if not sink else sink_slots[:b],
            )  # fmt: skip
    for n in (1, 2, 3, 7, 9, 33, 64, 100):
        rows = slice(1, 4)  # 998, 1995 and 305 tokens
        qlen = min(n, int(lens_host[rows].min()))
        q = torch.randn((3 * qlen, hq, d), generator=gen).to(dev, dtype)
        qsl = torch.arange(0, 3 * qlen + 1, qlen, dtype=torch.int32, device=dev)
        kk.multi_query_attention(
            q, qsl, cache, staging, table[rows], lens[rows], quant[rows], slots[rows], preset,
            d**-0.5, max_query_len=qlen, sink_lens=None if not sink else sink_lens[rows],
            sink_slots=None if not sink else sink_slots[rows],
        )  # fmt: skip
    for rows in (1, 16, 129):
        x = torch.randn((rows, hq, d), generator=gen).to(dev, dtype)
        kk.unrotate(kk.rotate(x))
    kk.dequantize(cache, table[0, :3].contiguous(), preset, d, dtype=dtype)
    torch.cuda.synchronize()
    assert kk.compiled_variants() == before
