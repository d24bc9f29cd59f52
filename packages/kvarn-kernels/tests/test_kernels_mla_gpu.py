"""MLA latent-cache kernels on the GPU at real sizes (``pytest -m gpu``): DeepSeek/GLM shapes
(latent 512, RoPE 64, 16 and 128 query heads), contexts up to 32K, CUDA-graph replay.

bf16 is tested here only: Triton 3.6's interpreter computes ``tl.dot`` on bf16 operands wrongly
(a 16x16 bf16 dot is off by 2e10 there), so the CPU tests use fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvarn_kernels import settings
from kvarn_kernels.mla import (
    allocate_mla_cache,
    dequantize_latent,
    mla_decode_attention,
    stage_latent,
    store_latent,
)
from kvarn_math.mla import decode_latent_tiles, encode_latent_tiles, mla_layout
from kvarn_math.testing import assert_close_rms, make_kv
from mla_testing import build_batch, reference

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["verified", "fast"])
def mla_kernel(request):
    """The decode tests run both kernels of ``KVARN_KERNELS_MLA_DECODE`` (``fast`` failed 7
    of these tests on 2026-12-06 before its centred-code fix; one GPU run checks both)."""
    with settings.override(mla_decode=request.param):
        yield request.param


DEV = "cuda"
# bf16 operands in the dots (fp32 accumulation): about 2^-8 relative per logit and output
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("preset", ["kvarn_mla_l4_g128", "kvarn_mla_l2_g128", "kvarn_mla_l4_g64"])
@pytest.mark.parametrize("dist", ["gaussian", "outlier_channels"])
def test_store_is_byte_exact_and_order_free(preset: str, dist: str) -> None:
    """4,096 tokens written in a shuffled order, in two chunks, give kvarn-math's records."""
    g = mla_layout(preset).group_size
    n_tiles = 4096 // g
    lat = make_kv((n_tiles * g, 512), dist, 1)
    pe = make_kv((n_tiles * g, 64), dist, 2) * 4
    lat_t = torch.from_numpy(lat).to(DEV, torch.bfloat16)
    pe_t = torch.from_numpy(pe).to(DEV, torch.bfloat16)
    expect = encode_latent_tiles(
        lat_t.float().cpu().numpy().reshape(n_tiles, g, 512),
        pe_t.float().cpu().numpy().reshape(n_tiles, g, 64),
        preset,
    )
    blocks = torch.randperm(n_tiles + 3, generator=torch.Generator().manual_seed(0))[:n_tiles]
    slots = (blocks[:, None] * g + torch.arange(g)[None, :]).reshape(-1).to(DEV)
    order = torch.randperm(n_tiles * g, generator=torch.Generator().manual_seed(1)).to(DEV)
    cache = allocate_mla_cache(n_tiles + 3, preset, device=DEV)
    half = order.shape[0] // 2
    for part in (order[:half], order[half:]):
        store_latent(lat_t[part], pe_t[part], cache, slots[part], preset)
    got = cache[blocks.to(DEV)].cpu().numpy()
    mismatch = np.argwhere(got != expect)
    assert mismatch.size == 0, f"{len(mismatch)} bytes differ, first at {mismatch[:3].tolist()}"


def test_dequantize_is_exact_at_size() -> None:
    preset = "kvarn_mla_l4_g128"
    lat = make_kv((64, 128, 512), "heavy_tailed", 3)
    pe = make_kv((64, 128, 64), "gaussian", 4)
    rec = encode_latent_tiles(lat, pe, preset)
    cache = torch.from_numpy(rec).to(DEV)
    ids = torch.arange(63, -1, -1, dtype=torch.int32, device=DEV)
    out = dequantize_latent(cache, ids, preset, dtype=torch.float32).cpu().numpy()
    d_lat, d_pe = decode_latent_tiles(rec[::-1], preset)
    assert np.array_equal(out[:, :512], d_lat.reshape(-1, 512))
    assert np.array_equal(out[:, 512:], d_pe.reshape(-1, 64))
    bf = dequantize_latent(cache, ids, preset).float().cpu()
    assert torch.equal(bf, torch.from_numpy(out).to(torch.bfloat16).float())


CASES = [
    # heads, seq_lens, quantized_lens (multiples of 128), dtype
    (16, [32768 + 77, 5000, 129, 1, 0], [32768, 4864, 128, 0, 0], torch.bfloat16),
    (128, [32768 + 5, 8192, 300], [32768, 8064, 256], torch.bfloat16),
    (128, [4096 + 130, 1], [4096, 0], torch.float32),
    (16, [16384, 20000], [16256, 19968], torch.float32),
]


@pytest.mark.parametrize(("heads", "seq_lens", "quantized_lens", "dtype"), CASES)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_matches_reference(heads, seq_lens, quantized_lens, dtype, splits, mla_kernel):
    preset = "kvarn_mla_l4_g128"
    batch = build_batch(
        preset,
        seq_lens,
        quantized_lens,
        ring_tiles=2,
        dist="outlier_channels",
        device=DEV,
        dtype=dtype,
    )
    rng = np.random.default_rng(5)
    q_lat = (rng.standard_normal((len(seq_lens), heads, 512)) / 64).astype(np.float32)
    q_pe = (rng.standard_normal((len(seq_lens), heads, 64)) / 8).astype(np.float32)
    ql = torch.from_numpy(q_lat).to(DEV, dtype)
    qp = torch.from_numpy(q_pe).to(DEV, dtype)
    scale = 1 / np.sqrt(192)
    out = mla_decode_attention(
        ql,
        qp,
        batch.cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
        num_splits=splits,
    )
    want = reference(batch, ql.float().cpu().numpy(), qp.float().cpu().numpy(), preset, scale)
    got = out.float().cpu().numpy()
    for b in range(len(seq_lens)):
        if seq_lens[b] == 0:
            assert (got[b] == 0).all()
        else:
            assert_close_rms(want[b], got[b], TOL[dtype], what=f"sequence {b}")


def _decode_at_size(preset, heads, seq_lens, quantized_lens, dtype, **kw):
    batch = build_batch(
        preset,
        seq_lens,
        quantized_lens,
        ring_tiles=2,
        dist="outlier_channels",
        device=DEV,
        dtype=dtype,
    )
    rng = np.random.default_rng(11)
    ql = torch.from_numpy(rng.standard_normal((len(seq_lens), heads, 512)) / 64).to(DEV, dtype)
    qp = torch.from_numpy(rng.standard_normal((len(seq_lens), heads, 64)) / 8).to(DEV, dtype)
    scale = 1 / np.sqrt(192)
    args = (ql, qp, batch.cache, batch.staging, batch.block_table, batch.seq_lens)
    args += (batch.quantized_lens, batch.staging_slots, preset, scale)
    return batch, ql, qp, scale, lambda: mla_decode_attention(*args, **kw)


# preset, heads, dtype, launch settings: the other presets, 20 heads (GLM-4.7-Flash), fp16 (the
# 1024 magic number), 8-bit codes (exact conversion), and the settings the benchmark sweeps
VARIANTS = [
    ("kvarn_mla_l2_g128", 16, torch.bfloat16, {}),
    ("kvarn_mla_l4_g64", 20, torch.bfloat16, {}),
    ("kvarn_mla_l4_g128", 16, torch.float16, {}),
    ("kvarn_mla_l8_g128", 16, torch.bfloat16, {}),
    ("kvarn_mla_l4_g128", 16, torch.bfloat16, {"block_tokens": 64, "num_warps": 8}),
    ("kvarn_mla_l4_g128", 16, torch.bfloat16, {"num_stages": 3, "num_splits": 64}),
    ("kvarn_mla_l4_g128", 128, torch.bfloat16, {"heads_per_program": 64, "block_tokens": 32}),
    ("kvarn_mla_l4_g128", 128, torch.bfloat16, {"heads_per_program": 16, "block_tokens": 32}),
    ("kvarn_mla_l4_g128", 16, torch.bfloat16, {"tokens_on_m": True, "block_tokens": 64}),
    (
        "kvarn_mla_l4_g128",
        128,
        torch.bfloat16,
        {"tokens_on_m": True, "heads_per_program": 32, "block_tokens": 64, "num_warps": 8},
    ),
]


@pytest.mark.parametrize(("preset", "heads", "dtype", "kw"), VARIANTS)
def test_decode_variants_match_reference(preset, heads, dtype, kw, mla_kernel) -> None:
    seq_lens, quantized_lens = [8192 + 77, 3000, 1], [8192, 2944, 0]
    batch, ql, qp, scale, run = _decode_at_size(
        preset, heads, seq_lens, quantized_lens, dtype, **kw
    )
    want = reference(batch, ql.float().cpu().numpy(), qp.float().cpu().numpy(), preset, scale)
    got = run().float().cpu().numpy()
    for b in range(len(seq_lens)):
        assert_close_rms(want[b], got[b], TOL[dtype], what=f"sequence {b}")


@pytest.mark.parametrize(
    ("preset", "heads"),
    [("kvarn_mla_l4_g128", 16), ("kvarn_mla_l4_g128", 128), ("kvarn_mla_l2_g128", 16)],
)
def test_ptx_unpack_matches_the_portable_one(preset, heads) -> None:
    """The inline-PTX unpack (two codes a register) gives what Triton's shifts and masks give
    (``KVARN_KERNELS_NO_ASM=1``): the same codes into the same dots."""
    seq_lens, quantized_lens = [16384 + 5, 700], [16384, 640]
    _, _, _, _, run = _decode_at_size(preset, heads, seq_lens, quantized_lens, torch.bfloat16)
    with settings.override(no_asm=False, mla_decode="fast"):
        fast = run()
    with settings.override(no_asm=True, mla_decode="fast"):
        portable = run()
    torch.testing.assert_close(fast, portable, rtol=1e-2, atol=1e-3 * portable.abs().max().item())


def test_decode_replays_in_a_cuda_graph(mla_kernel) -> None:
    """Fixed grid, no host sync: a captured decode follows new lengths in its inputs."""
    preset = "kvarn_mla_l4_g128"
    batch = build_batch(
        preset, [4000, 900], [3968, 896], ring_tiles=2, device=DEV, dtype=torch.bfloat16
    )
    ql = torch.randn(2, 16, 512, device=DEV, dtype=torch.bfloat16) / 16
    qp = torch.randn(2, 16, 64, device=DEV, dtype=torch.bfloat16) / 8
    args = (
        batch.cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.07,
    )
    out = torch.empty_like(ql)
    mla_decode_attention(ql, qp, *args, out=out, num_splits=8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_attention(ql, qp, *args, out=out, num_splits=8)
    first = out.clone()
    batch.seq_lens.copy_(torch.tensor([3990, 880], dtype=torch.int32))
    graph.replay()
    eager = mla_decode_attention(ql, qp, *args, num_splits=8)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert not torch.equal(out, first)


def test_stage_rows_at_size() -> None:
    """1,000 tokens of 8 sequences into a 2-tile ring; padding tokens write nothing."""
    t = 1000
    lat = torch.randn(t, 512, device=DEV, dtype=torch.bfloat16)
    pe = torch.randn(t, 64, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(t, device=DEV) % 8
    positions = torch.arange(t, device=DEV) // 8
    slots[::97] = -1
    staging = torch.zeros(8, 256, 576, device=DEV, dtype=torch.bfloat16)
    stage_latent(lat, pe, staging, slots, positions)
    keep = slots >= 0
    got = staging[slots[keep], positions[keep] % 256]
    assert torch.equal(got, torch.cat([lat, pe], 1)[keep])
    skipped = (slots < 0).nonzero()[:, 0]
    # a skipped token's own row holds nothing of it (zeros: no other token maps there)
    assert (staging[skipped % 8, (skipped // 8) % 256] == 0).all()
