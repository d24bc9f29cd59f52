"""MLA latent-cache kernels against kvarn-math in Triton's interpreter (small, awkward sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvarn_kernels import settings
from kvarn_kernels.mla import (
    allocate_mla_cache,
    choose_mla_splits,
    default_heads_per_program,
    dequantize_latent,
    mla_cache_shape,
    mla_decode_attention,
    stage_latent,
    store_latent,
)
from kvarn_math.mla import decode_latent_tiles, encode_latent_tiles, mla_layout
from kvarn_math.testing import make_kv
from mla_testing import build_batch, reference

pytestmark = pytest.mark.interpreter


@pytest.fixture(params=["verified", "fast"])
def mla_kernel(request):
    """Each decode test runs both kernels of ``KVARN_KERNELS_MLA_DECODE``."""
    with settings.override(mla_decode=request.param):
        yield request.param


@pytest.mark.parametrize(
    ("preset", "dist", "width"),
    [
        ("kvarn_mla_l4_g64", "outlier_channels", 512),
        ("kvarn_mla_l2_g128", "heavy_tailed", 256),
        ("kvarn_mla_l8_g128", "gaussian", 512),
    ],
)
def test_store_writes_the_reference_rows(preset: str, dist: str, width: int) -> None:
    """Tokens in shuffled slots (and padding slots) give kvarn-math's bytes, row by row; rows
    never written stay zero."""
    lay = mla_layout(preset, width, 64)
    g = lay.group_size
    rows = 24
    lat = make_kv((g, width), dist, 1)
    pe = make_kv((g, 64), dist, 2) * 5
    expect = encode_latent_tiles(lat[None], pe[None], preset)[0]
    chosen = np.random.default_rng(0).permutation(g)[:rows]
    slots = torch.tensor([2 * g + int(r) for r in chosen] + [-1], dtype=torch.int64)
    src_lat = torch.from_numpy(np.concatenate([lat[chosen], lat[:1]]))
    src_pe = torch.from_numpy(np.concatenate([pe[chosen], pe[:1]]))
    cache = allocate_mla_cache(3, preset, width, 64)
    store_latent(src_lat, src_pe, cache, slots, preset)
    got = cache.numpy()
    assert (got[:2] == 0).all()
    for f in lay.fields:
        per_row = f.nbytes // g
        for r in range(g):
            sl = slice(f.offset + r * per_row, f.offset + (r + 1) * per_row)
            want = expect[sl] if r in chosen else np.zeros(per_row, np.uint8)
            assert (got[2, sl] == want).all(), (f.name, r)


def test_dequantize_matches_decode() -> None:
    preset = "kvarn_mla_l4_g64"
    lat = make_kv((2, 64, 512), "heavy_tailed", 3)
    pe = make_kv((2, 64, 64), "gaussian", 4)
    rec = encode_latent_tiles(lat, pe, preset)
    cache = allocate_mla_cache(3, preset)
    cache[1], cache[2] = torch.from_numpy(rec[0]), torch.from_numpy(rec[1])
    out = dequantize_latent(
        cache, torch.tensor([2, 1], dtype=torch.int32), preset, dtype=torch.float32
    )
    d_lat, d_pe = decode_latent_tiles(rec[::-1], preset)
    assert np.array_equal(out[:, :512].numpy(), d_lat.reshape(-1, 512))
    assert np.array_equal(out[:, 512:].numpy(), d_pe.reshape(-1, 64))
    half = dequantize_latent(cache, torch.tensor([1], dtype=torch.int32), preset)
    assert half.dtype == torch.bfloat16
    # one bf16 step (the interpreter's bf16 conversion need not round to nearest)
    torch.testing.assert_close(half.float(), out[64:], rtol=2**-7, atol=0)


def _decode(batch, q_lat, q_pe, preset, scale, dtype=torch.float32, **kw):
    return mla_decode_attention(
        torch.from_numpy(q_lat).to(dtype),
        torch.from_numpy(q_pe).to(dtype),
        batch.cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        scale,
        **kw,
    )


def _queries(batch_size: int, heads: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q_lat = (rng.standard_normal((batch_size, heads, 512)) / 64).astype(np.float32)
    q_pe = (rng.standard_normal((batch_size, heads, 64)) / 8).astype(np.float32)
    return q_lat, q_pe


@pytest.mark.parametrize(
    ("preset", "heads", "seq_lens", "quantized_lens", "kw"),
    [
        # tiles + a tail of 37, the tail wrapping round a 2-tile ring; 20 heads (masked)
        ("kvarn_mla_l4_g64", 20, [64 * 3 + 37], [64 * 3], {"num_splits": 3}),
        # a batch: no key (padding), staging only, tiles only, both; one split and many
        ("kvarn_mla_l4_g64", 16, [0, 45, 128, 129], [0, 0, 128, 128], {"num_splits": 1}),
        ("kvarn_mla_l4_g64", 16, [0, 45, 128, 129], [0, 0, 128, 128], {"num_splits": 4}),
        ("kvarn_mla_l2_g128", 16, [128 + 5, 1], [128, 0], {"num_splits": 2}),
        ("kvarn_mla_l8_g128", 16, [128 + 100], [128], {}),
        # 128 heads (4 head blocks of 32), lengths of 1, 63 and 3 tiles + 1, 3 splits (the
        # longest sequence's 4 tiles share out 2 a split; the short ones leave splits empty),
        # chunks of 16 rows
        (
            "kvarn_mla_l4_g64",
            128,
            [1, 63, 64 * 3 + 1],
            [0, 0, 64 * 3],
            {"num_splits": 3, "block_tokens": 16},
        ),
        # 16 heads in a 64-head program (48 masked), whole 64-row chunks, 2-bit codes
        ("kvarn_mla_l2_g128", 16, [128 * 2 + 127], [128 * 2], {"heads_per_program": 64}),
        # the dots transposed (tokens on M), 20 heads in 32-head programs, a tail, 2 splits
        (
            "kvarn_mla_l4_g64",
            20,
            [64 * 3 + 37, 50],
            [64 * 3, 0],
            {"tokens_on_m": True, "num_splits": 2, "heads_per_program": 32},
        ),
    ],
)
def test_decode_matches_reference(preset, heads, seq_lens, quantized_lens, kw, mla_kernel) -> None:
    batch = build_batch(preset, seq_lens, quantized_lens, ring_tiles=2, dist="outlier_channels")
    q_lat, q_pe = _queries(len(seq_lens), heads)
    scale = 1 / np.sqrt(192)
    if kw.get("num_splits", 1) > 1:
        kw = {**kw, "min_tiles": 1}
    out = _decode(batch, q_lat, q_pe, preset, scale, **kw)
    want = reference(batch, q_lat, q_pe, preset, scale)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_decode_splits_share_each_sequence(mla_kernel) -> None:
    """The result does not depend on the split count, the table's width or min_tiles beyond
    float rounding (the fast kernel shares each sequence's own tiles out over the splits, at
    least min_tiles a split; the verified one cuts the table's width into equal splits and
    ignores min_tiles)."""
    preset = "kvarn_mla_l4_g64"
    batch = build_batch(preset, [64 * 7 + 3, 64 * 2], [64 * 7, 64 * 2], ring_tiles=1)
    wide = torch.full((2, 40), batch.block_table.max().item(), dtype=torch.int32)
    wide[:, : batch.block_table.shape[1]] = batch.block_table
    q_lat, q_pe = _queries(2, 16, seed=9)
    outs = [
        _decode(batch, q_lat, q_pe, preset, 0.1, num_splits=s, min_tiles=m)
        for s, m in ((1, 4), (3, 1), (8, 4))
    ]
    batch.block_table = wide
    outs.append(_decode(batch, q_lat, q_pe, preset, 0.1))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


def test_decode_fp16_codes_through_the_exponent_bits(mla_kernel) -> None:
    """fp16 queries: the fast kernel's codes enter as ``1024 + code`` (the magic-number path,
    the same Triton code as bf16's ``128 + code``), centred exactly; the verified kernel's
    dequantized values are rounded to fp16."""
    preset = "kvarn_mla_l4_g128"
    batch = build_batch(preset, [128 * 2 + 9], [128 * 2], ring_tiles=1, dist="heavy_tailed")
    q_lat, q_pe = _queries(1, 16, seed=3)
    scale = 1 / np.sqrt(192)
    out = _decode(batch, q_lat, q_pe, preset, scale, dtype=torch.float16, num_splits=2)
    q16 = torch.from_numpy(q_lat).half().float().numpy()
    p16 = torch.from_numpy(q_pe).half().float().numpy()
    want = reference(batch, q16, p16, preset, scale)
    # fp16 operands (weights rounded to 11 bits) and an fp16 output
    np.testing.assert_allclose(out.float().numpy(), want, rtol=0, atol=4e-3 * np.abs(want).max())


def test_decode_checks_arguments() -> None:
    preset = "kvarn_mla_l4_g64"
    batch = build_batch(preset, [70], [64], ring_tiles=1)
    q = torch.zeros(1, 16, 512)
    qpe = torch.zeros(1, 16, 64)
    args = (
        batch.cache,
        batch.staging,
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.1,
    )
    with pytest.raises(ValueError, match="q_rope must have dtype torch.float32"):
        mla_decode_attention(q, qpe.half(), *args)
    with pytest.raises(ValueError, match=r"cache must have shape \[\*, 21120\]"):
        mla_decode_attention(q, qpe, batch.cache[:, :100], *args[1:])
    with pytest.raises(ValueError, match="seq_lens must have dtype torch.int32"):
        mla_decode_attention(q, qpe, *args[:3], batch.seq_lens.long(), *args[4:])
    with pytest.raises(ValueError, match="heads_per_program must be a power of two"):
        mla_decode_attention(q, qpe, *args, heads_per_program=24)
    with pytest.raises(ValueError, match="latent_dim must be one of"):
        store_latent(
            torch.zeros(2, 384),
            torch.zeros(2, 64),
            batch.cache,
            torch.zeros(2, dtype=torch.int64),
            preset,
        )


def test_shapes_and_splits() -> None:
    assert mla_cache_shape(10, "kvarn_mla_l4_g128") == (10, 330 * 128)
    # one sequence of 256 tiles on 132 SMs: 64 splits of 4 tiles
    assert choose_mla_splits(1, 1, 256) == 64
    # 16 x 128 tiles: 16 wanted (264 programs at once), 8 tiles a split
    assert choose_mla_splits(16, 1, 128) == 16
    # 32 x 256 tiles: 8 wanted, not 9 (a second wave of 24 programs)
    assert choose_mla_splits(32, 1, 256) == 8
    # 9 wanted, 29 tiles a split: 9 splits; one program an SM: 4
    assert choose_mla_splits(28, 1, 256) == 9
    assert choose_mla_splits(28, 1, 256, programs_per_sm=1) == 4
    assert choose_mla_splits(64, 4, 256) == 1
    assert choose_mla_splits(1, 1, 3) == 1  # at least 4 tiles a split
    assert choose_mla_splits(1, 1, 3, min_tiles=1) == 3
    assert choose_mla_splits(2, 1, 4096, num_sms=16) == 16
    assert default_heads_per_program(16) == 16
    assert default_heads_per_program(20) == default_heads_per_program(128) == 32


def test_stage_then_decode_reads_the_staged_rows(mla_kernel) -> None:
    """Rows staged token by token (one padding token skipped) are what decode reads."""
    preset = "kvarn_mla_l4_g64"
    batch = build_batch(preset, [64 + 20], [64], ring_tiles=1)
    lat, pe = batch.tails[0]
    staging = torch.full_like(batch.staging, float("nan"))
    pos = torch.arange(64, 84)
    slots = batch.staging_slots.expand(20).clone()
    stage_latent(torch.from_numpy(lat), torch.from_numpy(pe), staging, slots, pos)
    # a padding token aimed at a real token's row writes nothing
    stage_latent(
        torch.zeros(1, 512), torch.zeros(1, 64), staging, torch.tensor([-1]), torch.tensor([64])
    )
    assert torch.equal(staging[0, 0:20, :512], torch.from_numpy(lat))
    assert torch.isnan(staging[0, 20:]).all()
    q = torch.randn(1, 16, 512) / 32
    qpe = torch.randn(1, 16, 64) / 8
    args = (
        batch.block_table,
        batch.seq_lens,
        batch.quantized_lens,
        batch.staging_slots,
        preset,
        0.1,
    )
    a = mla_decode_attention(q, qpe, batch.cache, staging, *args, num_splits=2)
    b = mla_decode_attention(q, qpe, batch.cache, batch.staging, *args, num_splits=2)
    assert torch.equal(a, b)


def test_decode_kernel_setting() -> None:
    """KVARN_KERNELS_MLA_DECODE: ``verified`` by default, ``fast`` on request, else an error
    naming the variable."""
    read = settings.KernelSettings.from_env
    assert read({}).mla_decode == "verified"
    assert read({"KVARN_KERNELS_MLA_DECODE": "fast"}).mla_decode == "fast"
    with pytest.raises(ValueError, match="KVARN_KERNELS_MLA_DECODE"):
        read({"KVARN_KERNELS_MLA_DECODE": "faster"})
